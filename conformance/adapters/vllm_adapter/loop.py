"""The engine core's loop around vLLM's scheduler, and the fake model runner.

``VllmAdapter`` plays ``EngineCore.step_with_batch_queue`` (``EngineCore.step`` at depth 1) call
for call over the scheduler ``build.py`` makes, with a model runner that samples one token per
request that reached the end of its known tokens (the token drawn by Hypothesis through
``choices``). It emits the engine-core decisions (``arrive``, ``begin``/``submit``,
``execute``/``commit``, ``abort``, ``reset``); the block-lifecycle effects come from the
wrappers of ``attach.py``. The package docstring says what each factory runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from . import kv_stream
from .attach import Attachment, Event
from .build import block_hasher, build_scheduler

VOCAB = 4
"""Sampled tokens are 0 .. VOCAB - 1; token 0 is a stop token (``Config.stop_token``)."""


@dataclass
class InFlight:
    """A submitted step in the batch queue: vLLM's output, the requests the model runner
    samples (their chunk reaches the last known token) and those preempted since."""

    step: int
    output: Any
    samples: dict[str, int]
    """Request id -> the position of the token the runner samples for it."""
    left: set[str] = field(default_factory=set)


class VllmAdapter:
    supports_loads = False

    def __init__(
        self,
        config: Config,
        choices: Choices,
        drop_stale: bool = False,
        async_scheduling: bool = False,
    ) -> None:
        self.config = config
        self.choices = choices
        self.events: list[Event] = []
        self.scheduler = build_scheduler(config, async_scheduling)
        self.hasher = block_hasher(config.block_size)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.arrived: list[int] = []
        self.queue: list[InFlight] = []  # EngineCore's batch queue, oldest first
        self._process_next = False  # the current step_with_batch_queue call goes on to output
        self.drop_stale = drop_stale
        self.stale_outputs = 0  # sampled outputs of requests preempted since their step began
        self.scheduler.requires_kv_delivery = drop_stale  # vLLM's drop mode (module docstring)
        self.next_step = 0
        self.attachment = Attachment(self.scheduler, self.events, config.block_size, self._left)
        self.problems = self.attachment.problems
        self.kv_stream = kv_stream.VllmKvStream(self.scheduler) if kv_stream.enabled() else None

    def _left(self, request_id: str) -> None:
        """vLLM preempted the request: its output in every submitted step is stale."""
        for in_flight in self.queue:
            in_flight.left.add(request_id)

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
        self.events.append(("arrive", rid, tuple(prompt), max_tokens, priority))
        self.arrived.append(rid)
        self.scheduler.add_request(request)

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
        self.events.append(("begin", step))
        output = self.scheduler.schedule()
        self.events.append(("submit", step))
        requests = self.scheduler.requests
        samples = {  # the runner samples where the chunk reaches the last known token: there
            r: requests[r].num_computed_tokens  # (the sampled token's position)
            for r in output.num_scheduled_tokens
            if not requests[r].is_prefill_chunk
        }
        self.queue.append(InFlight(step, output, samples))
        executed = output.total_num_scheduled_tokens > 0
        full = len(self.queue) >= self.config.depth
        self._process_next = full or not (executed or self.scheduler.has_requests())
        return True

    def _process_oldest(self) -> None:
        """The worker's output of the oldest step, then ``update_from_output``. The runner
        samples a token for every request whose chunk reached its last known token; vLLM skips
        the output of requests aborted since. A request preempted since has *stale* output:
        with ``drop_stale`` vLLM drops it itself; otherwise the runner withholds the token, as
        the spec discards it (vLLM would deliver it; module docstring)."""
        oldest = self.queue.pop(0)
        self.events.append(("execute", oldest.step, ()))
        sampled: list[tuple[int, int]] = []
        tokens: dict[str, list[int]] = {}
        before: dict[str, int] = {}
        for req_id, position in oldest.samples.items():
            request = self.scheduler.requests.get(req_id)
            stale = req_id in oldest.left
            self.stale_outputs += stale
            if request is None or request.is_finished() or (stale and not self.drop_stale):
                continue
            tokens[req_id] = [self.choices.pick(VOCAB, "vllm-token")]
            before[req_id] = request.num_tokens
            if not stale:
                sampled.append((int(req_id), tokens[req_id][0]))
                if request.num_tokens != position:
                    self.problems.append(
                        f"r{req_id}'s token of step {oldest.step} was sampled for position "
                        f"{position}, vLLM appends it at {request.num_tokens}"
                    )
        self.events.append(("commit", oldest.step, tuple(sampled)))
        req_ids = list(oldest.output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[tokens.get(r, []) for r in req_ids],
        )
        self.scheduler.update_from_output(oldest.output, runner)
        used = {str(rid) for rid, _ in sampled}
        for req_id, count in before.items():  # vLLM appended exactly the tokens reported used
            request = self.scheduler.requests.get(req_id)
            grown = (request.num_tokens if request is not None else count + 1) - count
            if grown != (req_id in used):
                self.problems.append(
                    f"step {oldest.step}: vLLM appended {grown} tokens to r{req_id}, the "
                    f"adapter reported {int(req_id in used)}"
                )

    def abort(self, rid: int) -> bool:
        if rid not in self.live_requests():
            return False
        self.events.append(("abort", rid))
        self.scheduler.finish_requests(str(rid), RequestStatus.FINISHED_ABORTED)
        return True

    def reset_prefix_cache(self) -> bool:
        if self.queue:
            return False
        cached = sorted(b.block_id for b in self.pool.blocks if b.block_hash is not None)
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():
            return False
        self.events.append(("reset",))
        self.events.extend(("unpublish", block) for block in cached)
        return True

    def live_requests(self) -> list[int]:
        requests = self.scheduler.requests
        return [
            rid
            for rid in self.arrived
            if str(rid) in requests and not requests[str(rid)].is_finished()
        ]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        refcounts = (0,) + tuple(b.ref_cnt for b in self.pool.blocks[1:])
        free = tuple(b.block_id for b in self.pool.free_block_queue.get_all_free_blocks())
        return refcounts, free

    def self_check(self) -> str | None:
        """The wrappers against vLLM's own KV events (``attach.Attachment.self_check``)."""
        return self.attachment.self_check()

    def check_kv_stream(self, judge: Any) -> Any:
        """The stream vLLM's publisher sent, judged (``kv_stream.py``); a ``Finding`` or None."""
        return None if self.kv_stream is None else self.kv_stream.check(judge)
