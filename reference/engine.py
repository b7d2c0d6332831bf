"""The engine loop (vLLM ``EngineCore`` with a batch queue of depth D) and the public API.

``step()`` does one of two things: if fewer than D steps are in flight and there is work to
schedule, it builds one step (begin, the discipline's decisions, submit), even an empty one;
otherwise it executes the oldest step in flight on the worker and commits its output
at once. With D >= 2 step N+1 is thus scheduled before step N executes.

The worker is pluggable (``worker.Worker``): the fake one by default (no tensors), or a model
runner (``kvspec.impl.llm.model_worker``) that computes real K/V and samples real tokens.
Without ``EngineConfig.async_scheduling`` a request whose entry samples in step N has
``computed == len(tokens)`` until step N commits, so no later step schedules it before then.
With it, step N+1 may compute the position whose token step N samples (a placeholder, as vLLM's
``AsyncScheduler`` does); since a step executes just before it commits, step N has committed
when step N+1 executes, so every token a live entry computes is in ``req.tokens`` by then, at
any D. Only an entry whose placeholder's sample was discarded (its request preempted with
stale output dropped, aborted, or finished at that commit: the entry is no longer live) may
reach past the known tokens when it executes; a worker computes garbage there, as a device
does.
"""

from __future__ import annotations

from .block_pool import BlockPool, Event
from .choices import Choices, DefaultChoices
from .config import EngineConfig
from .disciplines import schedule_general, schedule_vllm
from .groups import GroupedKV
from .hashing import pack_tokens
from .kv_cache_manager import KVCacheManager
from .memory import BadRead, GroupMemory
from .own_registration import make_own
from .policies import Policy, make_policy
from .request import FINISHED, Request, Step
from .scheduler import Scheduler
from .worker import FakeWorker, StepLog, Worker


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        choices: Choices | None = None,
        record: bool = True,
        worker: Worker | None = None,
    ) -> None:
        self.config = config
        self.choices: Choices = DefaultChoices() if choices is None else choices
        self.record = record
        self.events: list[Event] = []
        sink = self.events if record else None
        self.pool = BlockPool(config.num_blocks, sink)
        window = config.sliding_window
        if config.groups and not config.grouped:  # one group as today's single one
            window = config.groups[0].window
        self.kv: KVCacheManager = (
            GroupedKV(
                self.pool, config.block_size, config.groups, config.align, config.prefix_caching
            )
            if config.grouped
            else KVCacheManager(
                self.pool, config.block_size, config.prefix_caching, config.spec_tokens > 0, window
            )
        )
        if config.slot_buffer == "extra_buffer":  # (config: a slot group, so the coordinator)
            assert isinstance(self.kv, GroupedKV)
            self.kv.tracks_per_request = 2
        if isinstance(self.kv, GroupedKV) and config.traits.publish == "by-engine":
            self.kv.windows_let_go = True  # as SGLang's SWA component (groups.let_go_windows)
        policy: Policy
        if not config.prefix_caching:
            policy = Policy(self.kv)
        elif config.traits.publish == "by-engine":  # its own registration, as SGLang's
            policy = make_own(config.traits, self.kv)
        else:
            policy = make_policy(config.traits, self.kv)
        self.scheduler = Scheduler(config, self.kv, policy, sink)
        self.worker: Worker = (
            FakeWorker(self.choices, config.block_size, config.vocab, record)
            if worker is None
            else worker
        )
        if config.spec_tokens and not isinstance(self.worker, FakeWorker):
            raise ValueError("speculative decoding runs on the fake worker only")
        if (config.sliding_window is not None or config.groups) and not isinstance(
            self.worker, FakeWorker
        ):
            raise ValueError("a sliding window or KV-cache groups run on the fake worker only")
        if config.grouped:
            assert isinstance(self.worker, FakeWorker)
            self.worker.memory = GroupMemory(config.groups, self.pool.blocks)
            assert isinstance(self.kv, GroupedKV)
            self.worker.memory.copies = self.kv.copies

    @property
    def requests(self) -> dict[int, Request]:
        return self.scheduler.requests

    @property
    def worker_log(self) -> list[StepLog]:
        """Per executed step, what the fake worker wrote and read (empty when not recording or
        with another worker)."""
        worker = self.worker
        if isinstance(worker, FakeWorker) and worker.log is not None:
            return worker.log
        return []

    @property
    def bad_reads(self) -> list[BadRead]:
        """Several KV-cache groups: every read of the wrong thing by a live entry so far, named
        by its invariant (``memory.GroupMemory``); empty otherwise."""
        worker = self.worker
        if isinstance(worker, FakeWorker) and worker.memory is not None:
            return worker.memory.bad_reads
        return []

    def add_request(
        self,
        rid: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        priority: int = 0,
        external: bool = False,
        read_limit: int | None = None,
        encoder: int = 0,
    ) -> None:
        """A request arrives. ``read_limit``: its prefix-cache hits are bounded to that many
        tokens (0: it reads nothing), as vLLM's ``prefix_cache_hit_limit``; one group only.
        ``encoder``: its encoder tokens (an encoder-decoder model's input), whose K/V each cross
        group's table holds; only with a cross group (the spec's ``arrive`` refuses it else),
        and its ``arrive`` event carries it when not 0 (``spec.events.TRAILING``)."""
        sched, cfg = self.scheduler, self.config
        prompt = tuple(prompt)
        if rid in sched.requests:
            raise ValueError(f"request id {rid!r} is taken")
        if not prompt:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be an int >= 1, got {max_tokens!r}")
        if not isinstance(priority, int):
            raise ValueError(f"request {rid!r}: priority must be an int, got {priority!r}")
        if type(encoder) is not int or encoder < 0:
            raise ValueError(f"request {rid!r}: encoder must be an int >= 0, got {encoder!r}")
        if encoder and not cfg.cross:
            raise ValueError(f"request {rid!r}: {encoder} encoder tokens but no cross group")
        tokens = len(prompt) + max_tokens + cfg.reach
        sizes = [g.block_size for g in cfg.groups] if cfg.grouped else [cfg.block_size]
        need = sum(-(-tokens // size) for size in sizes)
        if cfg.cross:  # a cross table holds the encoder tokens, not the decoder's
            cross = [g.block_size for g in cfg.groups if g.kind == "cross"]
            need += sum(-(-encoder // size) - -(-tokens // size) for size in cross)
        need -= sum(-(-tokens // g.block_size) - 1 for g in cfg.groups if g.kind == "slot")
        if need > cfg.num_blocks - 1:
            raise ValueError(
                f"request {rid!r}: {len(prompt)} + {max_tokens} tokens need {need} blocks, "
                f"the pool has {cfg.num_blocks - 1}"
            )
        if read_limit is not None and (type(read_limit) is not int or read_limit < 0):
            raise ValueError(f"request {rid!r}: read_limit must be an int >= 0 or None")
        if read_limit is not None and cfg.grouped:
            raise ValueError(f"request {rid!r}: a bounded read across groups is not modelled")
        packed = pack_tokens(prompt)
        req = Request(rid, prompt, packed, max_tokens, priority, len(sched.requests), external)
        req.read_limit = read_limit
        req.encoder = encoder
        if self.record:
            arrive = ("arrive", rid, prompt, max_tokens, priority)
            self.events.append((*arrive, encoder) if encoder else arrive)
        sched.add(req)

    def step(self) -> bool:
        sched = self.scheduler
        if len(sched.in_flight) < self.config.depth and sched.has_schedulable_work():
            step = sched.begin()
            if self.config.discipline == "vllm":
                schedule_vllm(sched, step)
            else:
                schedule_general(sched, step, self.choices)
            sched.submit(step)
            if self.config.spec_tokens and self.config.async_scheduling:
                self._propose(sched.drafting_scheduled(step))
            return True
        if sched.in_flight:
            step = sched.in_flight[0]
            requests = sched.requests
            failed = self.worker.execute(step, requests)
            step.failed = failed
            if self.record:
                self.events.append(("execute", step.step_id, failed))
            live, sample = step.live, self.worker.sample
            sampled = tuple(
                (rid, sample(step, requests[rid]))
                for rid, entry in step.entries.items()
                if entry.samples and rid in live
            )
            if self.config.spec_tokens:
                sampled = self._verify(step, sampled)
            sched.update_from_output(step, sampled)
            if self.config.spec_tokens and not self.config.async_scheduling:
                self._propose(sched.drafting(step))
            return True
        return False

    def _verify(
        self, step: Step, sampled: tuple[tuple[int, int], ...]
    ) -> tuple[tuple[int, int], ...]:
        """Speculative decoding: a request with draft tokens gets its accepted drafts' tokens
        and the bonus token (``choices``: ``rejected``, how many drafts the model rejects)."""
        out: list[tuple[int, int]] = []
        worker = self.worker
        assert isinstance(worker, FakeWorker)
        for rid, token in sampled:
            drafts = step.entries[rid].drafts
            rejected = self.choices.pick(drafts + 1, "rejected") if drafts else 0
            tokens = worker.sample_after(self.requests[rid], token, drafts - rejected)
            out += [(rid, t) for t in tokens]
        return tuple(out)

    def _propose(self, drafting: list[Request]) -> None:
        """Each request that just sampled (or, under async scheduling, whose sampling decode was
        just scheduled) gets up to K draft tokens for its next decode (``choices``: ``drafts``,
        how many fewer than K the drafter proposes)."""
        k = self.config.spec_tokens
        for req in drafting:
            req.drafts = k - self.choices.pick(k + 1, "drafts")
            self.scheduler.counters["draft_tokens"] += req.drafts

    def run(self, max_steps: int | None = None) -> int:
        """Step until there is nothing to do (or ``max_steps``); return the steps taken."""
        n = 0
        while (max_steps is None or n < max_steps) and self.step():
            n += 1
        return n

    def abort(self, rid: int) -> bool:
        req = self.scheduler.requests.get(rid)
        if req is None or req.status == FINISHED:
            return False
        self.scheduler.abort(req)
        return True

    def reset_prefix_cache(self) -> bool:
        if self.scheduler.in_flight or self.pool.in_use():
            return False
        if self.record:
            self.events.append(("reset",))
        self.pool.reset()
        return True

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(refcount of every block id 0..N-1, free queue block ids head first)."""
        return self.pool.snapshot()

    def has_unfinished(self) -> bool:
        sched = self.scheduler
        return bool(sched.waiting) or bool(sched.running)

    @property
    def stats(self) -> dict[str, int]:
        """Counters. ``steps``: steps committed; ``prompt_tokens``: prompt tokens of all
        arrivals; ``hit_tokens``: prefix-cache hits at first admissions (so at most
        ``prompt_tokens``); ``readmit_hit_tokens``: hits at re-admissions (after preemption or a
        failed load); ``lookup_tokens``: tokens of every admission's lookup; ``computed_tokens``:
        tokens computed by submitted steps; ``blocks_*``: pool operations; ``requests_finished``
        counts aborted requests too (``aborts``); ``placeholder_tokens``: positions scheduled
        before their token was sampled (async scheduling); ``stale_delivered``: samples of
        preempted requests appended at commit (stale output delivered)."""
        pool = self.pool
        out = dict(self.scheduler.counters)
        out.update(
            blocks_allocated=pool.n_allocated,
            blocks_touched=pool.n_touched,
            blocks_freed=pool.n_freed,
            blocks_evicted=pool.n_evicted,
            blocks_published=pool.n_published,
        )
        return out
