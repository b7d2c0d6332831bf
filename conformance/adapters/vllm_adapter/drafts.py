"""Speculative decoding through vLLM's own scheduler under ``kvspec fuzz --spec-tokens K``
(``drafts_factory``): the fuzzer reaches the drafts that kvspec's pytest plugin judges in vLLM's
tests.

vLLM is built with n-gram speculative decoding, K draft tokens per decode
(``SpeculativeConfig(method="ngram")``, what vLLM's own tests use on a CPU: ``build.py``), on
the synchronous ``Scheduler`` at depth 1, and this loop plays ``EngineCore.step`` and its
``post_step``: ``schedule()``, the model runner's output, ``update_from_output``, then the
drafter's proposals handed to ``Scheduler.update_draft_token_ids``. Only the drafter and the
model runner are stand-ins, each drawing through the fuzzer's ``choices``:

* the drafter proposes 0 to K tokens for each request of the step that sampled one (an n-gram
  drafter finds no match, or a shorter one, as often as a full one); vLLM itself ignores
  proposals for prefill chunks and finished requests and schedules what fits its budget;
* the runner accepts a leading run of a decode's scheduled drafts (0 to all, so some are
  rejected) and samples one bonus token after them; vLLM rolls the rejected ones back from the
  request's computed tokens and appends the accepted ones and the bonus, up to a stop.

Everything the spec judges is vLLM's: which drafts it schedules, the blocks it allocates and
registers for them, what it rolls back, and what it appends (``attach.py`` derives the events,
``Config.spec_tokens`` is K). The loop's own decisions (the ``commit``: each request's accepted
drafts then its bonus, cut after a stop token or at ``max_tokens``, as ``docs/events.md`` says)
are held to the attachment's by ``self_check``, and vLLM's appended tokens to the loop's count.

Depth 1 only: with a batch queue vLLM hands drafts to the step in flight
(``update_draft_token_ids_in_output``), which this loop does not play; deeper cells are refused
(``ValueError``, a cell the engine does not run). The plain factories refuse ``--spec-tokens``
instead of running without drafts (``supported``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.outputs import DraftTokenIds

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from . import versions
from .loop import VOCAB, VllmAdapter


class DraftsAdapter(VllmAdapter):
    """``VllmAdapter`` with n-gram speculative decoding, K = ``config.spec_tokens`` drafts."""

    def __init__(self, config: Config, choices: Choices, reuse: bool | None = None) -> None:
        if config.spec_tokens < 1:
            raise ValueError("the drafts factory needs --spec-tokens K >= 1")
        if config.depth != 1:
            raise ValueError(
                "vLLM with drafts runs here at depth 1 (EngineCore.step, then post_step's "
                f"drafts), not depth {config.depth}"
            )
        super().__init__(config, choices, drop_stale=False, async_scheduling=False, reuse=reuse)
        self.drafts_proposed = 0
        self.drafts_scheduled = 0
        self.drafts_rejected = 0
        self.rejecting: set[str] = set()
        """The requests some of whose drafts the output being processed rejects."""

    def _process_oldest(self) -> None:
        """The runner's output of the one step in flight (accepted drafts, then a bonus token),
        ``update_from_output``, then the drafter's proposals (``post_step``)."""
        oldest = self.queue.pop(0)
        output = oldest.output
        requests = self.scheduler.requests
        rows: dict[str, list[int]] = {}
        sampled: list[tuple[int, int]] = []
        expected: dict[str, tuple[Any, int, int]] = {}
        self.rejecting = set()
        for req_id, position in oldest.samples.items():
            drafts = [int(t) for t in output.scheduled_spec_decode_tokens.get(req_id, ())]
            accepted = self.choices.pick(len(drafts) + 1, "vllm-accepted-drafts")
            rows[req_id] = drafts[:accepted] + [self.choices.pick(VOCAB, "vllm-token")]
            self.drafts_scheduled += len(drafts)
            self.drafts_rejected += len(drafts) - accepted
            if accepted < len(drafts):
                self.rejecting.add(req_id)
            request = requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.num_tokens + len(drafts) != position:
                self.problems.append(
                    f"r{req_id}'s tokens of step {oldest.step} were sampled from position "
                    f"{position - len(drafts)}, vLLM appends them at {request.num_tokens}"
                )
            kept = self._appended(request, rows[req_id])
            sampled += [(int(req_id), token) for token in kept]
            expected[req_id] = (request, request.num_tokens, len(kept))
        req_ids = list(output.num_scheduled_tokens)
        runner = versions.runner_output(req_ids, [rows.get(r, []) for r in req_ids])
        start = len(self.events)
        self.decisions.append((start, ("execute", oldest.step, ())))
        self.decisions.append((start + 1, ("commit", oldest.step, tuple(sampled))))
        self.scheduler.update_from_output(output, runner)
        for event in self.events[start:]:
            if event[0] == "publish":
                self.coverage.post_output_publishes += 1
        for req_id, (request, before, count) in expected.items():
            if request.num_tokens - before != count:
                self.problems.append(
                    f"step {oldest.step}: vLLM appended {request.num_tokens - before} tokens "
                    f"to r{req_id}, the adapter expected {count}"
                )
        self._propose(req_ids, oldest.samples)

    @staticmethod
    def _appended(request: Any, tokens: list[int]) -> list[int]:
        """The tokens vLLM appends of a row: up to and including a stop token (0) or the one
        that reaches the request's ``max_tokens``."""
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            if token == 0 or request.num_output_tokens + len(kept) >= request.max_tokens:
                break
        return kept

    def _propose(self, req_ids: list[str], sampling: dict[str, int]) -> None:
        """``post_step``: the drafter's proposal for every request of the step, 0 to K tokens for
        those that sampled one (none for a prefill chunk), handed to vLLM as the engine core
        hands the model runner's ``take_draft_token_ids``."""
        proposals: list[list[int]] = []
        for req_id in req_ids:
            count = self.choices.pick(self.config.spec_tokens + 1, "vllm-drafts") * (
                req_id in sampling
            )
            proposals.append([self.choices.pick(VOCAB, "vllm-draft-token") for _ in range(count)])
            self.drafts_proposed += count
        self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, proposals))


def drafts_factory(config: Config, choices: Choices) -> DraftsAdapter:
    """vLLM's synchronous ``Scheduler`` with n-gram speculative decoding, ``--spec-tokens K``
    drafts per decode, at depth 1 (``kvspec fuzz --target ...vllm_adapter:drafts_factory
    --spec-tokens K --depth 1``)."""
    from . import supported

    why = supported(config, drafts=True)
    if why is not None:
        raise ValueError(why)
    return DraftsAdapter(config, choices)
