"""The engine core's loop around vLLM's scheduler, and the fake model runner.

``VllmAdapter`` plays ``EngineCore.step_with_batch_queue`` (``EngineCore.step`` at depth 1) call
for call over the scheduler ``build.py`` makes, with a model runner that samples one token per
request whose scheduled chunk reaches the end of its tokens (known ones and, under async
scheduling, the placeholders of the steps in flight), the token drawn by Hypothesis through
``choices``. Like a real runner it returns that token whatever became of the request since, and
vLLM decides what to do with it: skip it (aborted or finished), drop it (stale output in drop
mode) or deliver it (stale output by default). The ``commit`` event lists exactly the tokens vLLM
uses. It emits the engine-core decisions (``arrive``, ``begin``/``submit``, ``execute``/``commit``,
``abort``, ``reset``); the block-lifecycle effects come from the wrappers of ``attach.py``. The
package docstring says what each factory runs. ``Coverage`` counts the situations of async
scheduling and stale output the run went through.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from . import kv_stream, versions
from .attach import Event, attach
from .build import block_hasher, build_scheduler
from .reuse import enabled as reuse_enabled

VOCAB = 4
"""Sampled tokens are 0 .. VOCAB - 1; token 0 is a stop token (``Config.stop_token``)."""


@dataclass
class Coverage:
    """How often a run went through each situation that async scheduling and stale output add
    (counted from what vLLM did, for the fuzzing figures of ``docs/adapters.md``)."""

    placeholder_decodes: int = 0
    """Entries scheduled over a token an in-flight step has yet to sample."""
    preempted_in_flight: int = 0
    """Preemptions of a request that a submitted step still holds."""
    stale_delivered: int = 0
    """Tokens sampled for a request preempted since, that vLLM appended (default mode)."""
    stale_dropped: int = 0
    """The same, dropped by vLLM (drop mode)."""
    finished_held: int = 0
    """Requests that finished at a commit while a later step in flight still held them."""
    post_output_publishes: int = 0
    """Blocks registered by ``update_from_output`` (``cache_blocks`` after the output)."""
    post_output_publishes_ahead: int = 0
    """Of those, blocks with a slot that a later submitted step still computes (a block
    registered before its last write: vLLM's cap ``num_computed_tokens - num_in_flight_tokens``
    is meant to keep this at 0)."""
    unresolved_placeholders: int = 0
    """Samples vLLM discarded (aborted, finished or dropped since) whose position a later
    submitted step computes: the K/V written there holds a token nobody will know."""


@dataclass
class InFlight:
    """A submitted step in the batch queue: vLLM's output, the requests the model runner
    samples (their chunk reaches the last known token) and those preempted since."""

    step: int
    output: Any
    samples: dict[str, int]
    """Request id -> the position of the token the runner samples for it."""
    computes: dict[str, range]
    """Request id -> the positions the step computes for it."""
    left: set[str] = field(default_factory=set)


class VllmAdapter:
    supports_loads = False

    def __init__(
        self,
        config: Config,
        choices: Choices,
        drop_stale: bool = False,
        async_scheduling: bool = False,
        long_prefill_token_threshold: int = 0,
        reuse: bool | None = None,
    ) -> None:
        """``reuse``: build on the ``VllmConfig`` kept for the cell (``reuse.py``; None: unless
        ``KVSPEC_VLLM_REUSE=0``), else on one built now; everything else is built here."""
        if async_scheduling and config.depth < 2:
            raise ValueError("async scheduling keeps at least 2 steps in flight")
        self.config = replace(
            config,
            async_scheduling=async_scheduling,
            stale_output="drop" if drop_stale else "deliver",
        )
        """The spec's model of what runs: vLLM's scheduling and stale-output mode, whatever the
        config given said of them."""
        self.choices = choices
        self.coverage = Coverage()
        self.reuse = reuse_enabled() if reuse is None else reuse
        self.scheduler = self.build_scheduler(
            config, async_scheduling, long_prefill_token_threshold, self.reuse
        )
        self.hasher = block_hasher(self.scheduler.hash_block_size)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.arrived: list[int] = []
        self.queue: list[InFlight] = []  # EngineCore's batch queue, oldest first
        self._process_next = False  # the current step_with_batch_queue call goes on to output
        self.drop_stale = drop_stale
        self.scheduler.requires_kv_delivery = drop_stale  # vLLM's drop mode (package docstring)
        self.next_step = 0
        # Before attaching: the stream wraps update_from_output on the instance too, and the
        # attachment takes a wrapper it finds there for the scheduler's own.
        streams = self.streams_kv_events and kv_stream.enabled()
        self.kv_stream = kv_stream.VllmKvStream(self.scheduler) if streams else None
        # A refusal (``refusal``) ends the fuzzer's run and its search: nothing after is judged.
        self.attachment = attach(self.scheduler, self.config, on_preempt=self._left)
        self.events: list[Event] = self.attachment.events
        self.problems = self.attachment.problems
        self.decisions: list[tuple[int, Event]] = []
        """The engine core's decisions as this loop takes them, each with the index in ``events``
        where it emitted it before ``attach`` derived them from vLLM's entry points;
        ``self_check`` holds the attachment's events to them."""
        self._decisions_checked = 0

    streams_kv_events = True
    """Whether vLLM's KV-event stream runs and is judged (``kv_stream.py``)."""

    def build_scheduler(
        self, config: Config, async_scheduling: bool, threshold: int, reuse: bool
    ) -> Any:
        """vLLM's scheduler of the cell (``build.py``; ``hybrid.py`` builds a hybrid model's)."""
        return build_scheduler(config, async_scheduling, threshold, reuse)

    @property
    def refusal(self) -> Any:
        """The attachment's refusal (``attach.Refusal``), or None: the adapter protocol's."""
        return self.attachment.refusal

    @property
    def stale_outputs(self) -> int:
        """Sampled outputs of requests preempted since their step was submitted."""
        return self.coverage.stale_delivered + self.coverage.stale_dropped

    def _left(self, request_id: str) -> None:
        """vLLM preempted the request: its output in every submitted step is stale."""
        held = False
        for in_flight in self.queue:
            in_flight.left.add(request_id)
            held = held or request_id in in_flight.output.num_scheduled_tokens
        self.coverage.preempted_in_flight += held

    # -- the protocol ---------------------------------------------------------------------------

    def add_request(
        self,
        rid: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        priority: int,
        external: bool = False,
    ) -> None:
        if external:
            raise ValueError("the vLLM adapter has no external KV loads")
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[0])
        request = Request(
            request_id=str(rid),
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(len(self.arrived)),
            priority=priority,
            block_hasher=self.hasher,
        )
        self.arrived.append(rid)
        self.decisions.append(
            (len(self.events), ("arrive", rid, tuple(prompt), max_tokens, priority))
        )
        self.scheduler.add_request(request)
        if self.attachment.ids.get(str(rid)) != rid:
            self.problems.append(f"the attachment maps r{rid} to {self.attachment.ids}")

    def step(self) -> bool:
        """Half of one ``EngineCore.step_with_batch_queue`` call (``step`` at depth 1, whose
        queue of one behaves the same): schedule and submit a step, returning at once while the
        queue has room; else (or on the next call, if this one scheduled) take the oldest step
        and process its output. Aborts between the halves are vLLM's ``_process_aborts_queue``."""
        if self._process_next or (self.queue and not self.scheduler.has_requests()):
            self._process_next = False
            self._process_oldest()
            return True
        if not self.scheduler.has_requests():
            return False
        step = self.next_step
        self.next_step += 1
        self.decisions.append((len(self.events), ("begin", step)))
        output = self.scheduler.schedule()
        self.decisions.append((len(self.events) - 1, ("submit", step)))
        requests = self.scheduler.requests
        samples = {  # the runner samples where the chunk reaches the end of the request's
            r: requests[r].num_computed_tokens  # tokens: there (the sampled token's position)
            for r in output.num_scheduled_tokens
            if not requests[r].is_prefill_chunk
        }
        computes = {
            r: range(requests[r].num_computed_tokens - n, requests[r].num_computed_tokens)
            for r, n in output.num_scheduled_tokens.items()
        }
        self.coverage.placeholder_decodes += sum(  # entries that run past the known tokens
            requests[r].num_computed_tokens > requests[r].num_tokens for r in computes
        )
        self.queue.append(InFlight(step, output, samples, computes))
        executed = output.total_num_scheduled_tokens > 0
        full = len(self.queue) >= self.config.depth
        self._process_next = full or not (executed or self.scheduler.has_requests())
        return True

    def _process_oldest(self) -> None:
        """The worker's output of the oldest step, then ``update_from_output``. The runner
        samples a token for every request whose chunk reached the end of its tokens, as a real
        runner does whatever became of the request since; the ``commit`` lists the tokens vLLM
        uses: not those of requests aborted or finished since (vLLM skips them), nor, in drop
        mode, those of requests preempted since (stale: vLLM drops them; by default it delivers
        them to the waiting request)."""
        oldest = self.queue.pop(0)
        sampled: list[tuple[int, int]] = []
        tokens: dict[str, list[int]] = {}
        before: dict[str, int] = {}
        for req_id, position in oldest.samples.items():
            tokens[req_id] = [self.choices.pick(VOCAB, "vllm-token")]
            request = self.scheduler.requests.get(req_id)
            if request is None or request.is_finished():
                self._discarded(req_id, position, gone=True)
                continue
            before[req_id] = request.num_tokens
            if req_id in oldest.left and self.drop_stale:
                self.coverage.stale_dropped += 1
                self._discarded(req_id, position, gone=False)
                continue
            self.coverage.stale_delivered += req_id in oldest.left
            sampled.append((int(req_id), tokens[req_id][0]))
            if request.num_tokens != position:
                self.problems.append(
                    f"r{req_id}'s token of step {oldest.step} was sampled for position "
                    f"{position}, vLLM appends it at {request.num_tokens}"
                )
        req_ids = list(oldest.output.num_scheduled_tokens)
        runner = self.runner_output(oldest, req_ids, [tokens.get(r, []) for r in req_ids])
        start = len(self.events)
        failed = self.failed_loads(runner)
        self.decisions.append((start, ("execute", oldest.step, failed)))
        self.decisions.append((start + 1, ("commit", oldest.step, tuple(sampled))))
        self.scheduler.update_from_output(oldest.output, runner)
        for rid in failed:  # vLLM's ``fail`` policy ends the request: to the spec, an abort
            at = next(
                (i for i in range(start, len(self.events)) if self.events[i] == ("abort", rid)),
                None,
            )
            if at is None:
                self.problems.append(f"step {oldest.step}: r{rid}'s load failed, vLLM kept it")
            else:
                self.decisions.append((at, ("abort", rid)))
        for event in self.events[start:]:
            if event[0] == "publish":
                self.coverage.post_output_publishes += 1
                self.coverage.post_output_publishes_ahead += self._ahead(event[1], event[2])
        used = {str(rid) for rid, _ in sampled}
        for req_id, count in before.items():  # vLLM appended exactly the tokens reported used
            request = self.scheduler.requests.get(req_id)
            grown = (request.num_tokens if request is not None else count + 1) - count
            if grown != (req_id in used):
                self.problems.append(
                    f"step {oldest.step}: vLLM appended {grown} tokens to r{req_id}, the "
                    f"adapter reported {int(req_id in used)}"
                )
            if request is None or request.is_finished():
                held = any(req_id in later.output.num_scheduled_tokens for later in self.queue)
                self.coverage.finished_held += held

    def failed_loads(self, runner: Any) -> tuple[int, ...]:
        """The requests whose asynchronous load the runner's output reports failed (the
        ``execute`` decision's), sorted; none here (``loads.py`` draws them)."""
        return ()

    def runner_output(self, oldest: InFlight, req_ids: list[str], tokens: list[list[int]]) -> Any:
        """The model runner's output of the ``oldest`` step (``loads.py`` adds the worker's
        report of the step's KV loads)."""
        return versions.runner_output(req_ids, tokens)

    def _ahead(self, rid: int, index: int) -> bool:
        """Whether a submitted step still computes a slot of the request's block ``index``."""
        slots = range(index * self.config.block_size, (index + 1) * self.config.block_size)
        for later in self.queue:
            held = later.computes.get(str(rid))
            if held is not None and range(max(held.start, slots.start), min(held.stop, slots.stop)):
                return True
        return False

    def _discarded(self, req_id: str, position: int, gone: bool) -> None:
        """vLLM discards the token the oldest step sampled for the request at ``position``:
        count the later submitted steps that compute that position from it (all of them if the
        request is ``gone``, aborted or finished; else those scheduled before it was preempted)."""
        for later in self.queue:
            held = later.computes.get(req_id)
            if held is not None and position in held and (gone or req_id in later.left):
                self.coverage.unresolved_placeholders += 1

    def abort(self, rid: int) -> bool:
        if rid not in self.live_requests():
            return False
        self.decisions.append((len(self.events), ("abort", rid)))
        self.scheduler.finish_requests(str(rid), RequestStatus.FINISHED_ABORTED)
        return True

    def reset_prefix_cache(self) -> bool:
        if self.queue:
            return False
        cached = sorted(b.block_id for b in self.pool.blocks if b.block_hash is not None)
        at = len(self.events)
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():
            return False
        self.decisions.append((at, ("reset",)))
        self.decisions += [(at + 1 + i, ("unpublish", block)) for i, block in enumerate(cached)]
        return True

    def live_requests(self) -> list[int]:
        requests = self.scheduler.requests
        return [
            rid
            for rid in self.arrived
            if str(rid) in requests and not requests[str(rid)].is_finished()
        ]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.attachment.snapshot()

    def pool_view(self) -> Any:
        """vLLM's own books (``pool_view.py``): compared with the spec's by the fuzzer."""
        return self.attachment.pool_view()

    def self_check(self) -> str | None:
        """The attachment's events against the loop's decisions (``decisions``), then the
        wrappers against vLLM's own KV events (``attach.Attachment.self_check``)."""
        for at, decision in self.decisions[self._decisions_checked :]:
            got = self.events[at] if at < len(self.events) else None
            if got != decision:
                return f"the loop took {decision} as event {at}; the attachment emitted {got}"
        self._decisions_checked = len(self.decisions)
        return self.attachment.self_check()

    def check_kv_stream(self, judge: Any) -> Any:
        """The stream vLLM's publisher sent, judged (``kv_stream.py``); a ``Finding`` or None."""
        return None if self.kv_stream is None else self.kv_stream.check(judge)
