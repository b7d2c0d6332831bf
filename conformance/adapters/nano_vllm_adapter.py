"""nano-vllm-fork (PyPI ``nano-vllm-fork==20260210``): its real ``Scheduler`` and ``BlockManager``
through the adapter protocol (``--target kvspec.conformance.adapters.nano_vllm_adapter:factory``).

Importable only where nano-vllm-fork is installed (``make thirdparty`` builds ``.venv-nano``). The
package's ``__init__`` imports its model runner (flash-attn, CUDA); the scheduler and block manager
need neither, so they are imported as submodules without running that ``__init__``. nano-vllm has
no model runner we could use on a CPU, so the adapter plays it (one token per scheduled sequence,
drawn by Hypothesis; token 0 is its ``eos``).

How its semantics map onto the spec (``docs/adapters.md``):

* a step is ``Scheduler.schedule()``: all prefills (a whole prompt, less its cached blocks) or all
  decodes (one token each); every sequence scheduled samples;
* ``BlockManager.allocate`` at admission: ``hit`` (its cached blocks), ``alloc``, and ``publish``
  of every full prompt block at once (eager, like vLLM); ``may_append`` on a decode: ``alloc`` of a
  new block, or ``publish`` of the block the step's token completes;
* ``BlockManager.deallocate``: ``free`` per block, tail first; when a block's refcount reaches 0 its
  hash entry is deleted: an ``unpublish`` the engine does on its own (prefix hits therefore only
  happen between requests that overlap in time); an entry overwritten by another block of the same
  hash is an ``unpublish`` too;
* ``Scheduler.preempt``: ``preempt``; its victims are the running sequences not yet scheduled in
  the step, taken from the front, which is not vLLM's rule: the cell is the ``general`` discipline;
* no abort, no prefix-cache reset, no priorities: ``abort`` and ``reset_prefix_cache`` return False;
* block ids: nano-vllm has no null block, so its block i is the spec's block i + 1;
* ``max_num_seqs`` bounds one step's batch, not the running set, and a prompt is admitted whole, so
  the adapter declares a token budget of the whole pool and a max-running of N.

Judging is *observed*: nano-vllm allocates from a FIFO free list, not the spec's LRU queue.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import replace

_spec = importlib.util.find_spec("nanovllm")
if _spec is None or not _spec.submodule_search_locations:
    raise ImportError(
        "the nano-vllm adapter needs nano-vllm-fork==20260210: run `make thirdparty` and use "
        ".venv-nano/bin/kvspec"
    )
if "nanovllm" not in sys.modules:  # the package without its __init__ (which needs CUDA)
    _package = types.ModuleType("nanovllm")
    _package.__path__ = list(_spec.submodule_search_locations)
    sys.modules["nanovllm"] = _package

from nanovllm.engine.block_manager import BlockManager  # noqa: E402
from nanovllm.engine.scheduler import Scheduler  # noqa: E402
from nanovllm.engine.sequence import Sequence, SequenceStatus  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402

from kvspec.conformance.engine_view import PoolView  # noqa: E402
from kvspec.reference.choices import Choices  # noqa: E402
from kvspec.spec import Config  # noqa: E402

Event = tuple[object, ...]
VOCAB = 4
"""Sampled tokens are 0 .. VOCAB - 1; token 0 is nano-vllm's eos (``Config.stop_token``)."""


def factory(config: Config, choices: Choices) -> NanoVllmAdapter:
    if config.policy != "eager-unsafe":
        raise ValueError(
            f"nano-vllm registers blocks when it allocates them: policy eager-unsafe, not {config.policy}"
        )
    if config.discipline != "general":
        raise ValueError("nano-vllm preempts the front of its running queue: discipline general")
    if config.depth != 1:
        raise ValueError(f"nano-vllm runs one step at a time: depth 1, not {config.depth}")
    if config.stop_token not in (None, 0):
        raise ValueError(f"the fake model runner's eos is 0, not {config.stop_token}")
    if not config.prefix_caching:
        raise ValueError("nano-vllm always caches prefixes: prefix caching on")
    return NanoVllmAdapter(config, choices)


class NanoVllmAdapter:
    judging = "observed"
    supports_loads = False

    def __init__(self, config: Config, choices: Choices) -> None:
        pool_tokens = (config.num_blocks - 1) * config.block_size
        self.config = replace(
            config,
            token_budget=max(config.token_budget, pool_tokens),
            max_running=max(config.max_running, config.num_blocks),
            stop_token=0,
        )
        self.choices = choices
        self.events: list[Event] = []
        settings = types.SimpleNamespace(
            max_num_seqs=config.max_running,
            max_num_batched_tokens=self.config.token_budget,
            eos=0,
            num_kvcache_blocks=config.num_blocks - 1,
            kvcache_block_size=config.block_size,
        )
        self.scheduler = Scheduler(settings)  # reads only these five fields
        self.manager: BlockManager = self.scheduler.block_manager
        self.rid: dict[int, int] = {}  # nano-vllm seq_id -> request id
        self.seqs: dict[int, Sequence] = {}  # request id -> sequence
        self.in_flight: tuple[int, list[Sequence]] | None = None
        self.next_step = 0
        self._wrap()

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
            raise ValueError("nano-vllm has no external KV loads")
        seq = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens))
        seq.block_size = self.config.block_size  # a class attribute (256) in nano-vllm
        self.rid[seq.seq_id] = rid
        self.seqs[rid] = seq
        self.events.append(("arrive", rid, tuple(prompt), max_tokens, priority))
        self.scheduler.add(seq)

    def step(self) -> bool:
        if self.in_flight is None:
            if self.scheduler.is_finished():
                return False
            step = self.next_step
            self.next_step += 1
            self.events.append(("begin", step))
            seqs, _ = self.scheduler.schedule()
            self.events.append(("submit", step))
            self.in_flight = (step, seqs)
            return True
        step, seqs = self.in_flight
        self.in_flight = None
        self.events.append(("execute", step, ()))
        tokens = [self.choices.pick(VOCAB, "nano-token") for _ in seqs]
        sampled = tuple((self.rid[s.seq_id], t) for s, t in zip(seqs, tokens, strict=True))
        self.events.append(("commit", step, sampled))
        self.scheduler.postprocess(seqs, tokens)
        return True

    def abort(self, rid: int) -> bool:
        return False  # nano-vllm has no abort

    def reset_prefix_cache(self) -> bool:
        return False  # nor a prefix-cache reset

    def live_requests(self) -> list[int]:
        return [rid for rid, seq in self.seqs.items() if not seq.is_finished]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        refcounts = (0,) + tuple(b.ref_count for b in self.manager.blocks)
        return refcounts, tuple(b + 1 for b in self.manager.free_block_ids)

    def pool_view(self) -> PoolView:
        """nano-vllm's own books (``engine_view.py``): the free count its set of used blocks
        implies (its hit path asks that set whether a block is free), and its hash index, the
        entries whose block still carries the hash (a lookup checks the block's tokens too). No
        evictable set: a freed block's entry is deleted."""
        manager = self.manager
        blocks = manager.blocks
        return PoolView(
            free_count=len(blocks) - len(manager.used_block_ids),
            index=tuple(
                (b + 1,) for h, b in manager.hash_to_block_id.items() if blocks[b].hash == h
            ),
        )

    # -- the wrapped methods --------------------------------------------------------------------

    def _index(self) -> set[tuple[int, int]]:
        return set(self.manager.hash_to_block_id.items())

    def _registrations(self, seq: Sequence, before: set[tuple[int, int]]) -> list[Event]:
        """``unpublish`` for entries that disappeared, ``publish`` for entries that appeared (with
        the block's position in ``seq``'s table), in table order."""
        after = self._index()
        events: list[Event] = [("unpublish", b + 1) for _, b in sorted(before - after)]
        added = {b for _, b in after - before}
        rid = self.rid[seq.seq_id]
        events += [("publish", rid, i, b + 1) for i, b in enumerate(seq.block_table) if b in added]
        return events

    def _wrap(self) -> None:
        manager, scheduler = self.manager, self.scheduler
        allocate, may_append, deallocate = (
            manager.allocate,
            manager.may_append,
            manager.deallocate,
        )
        preempt = scheduler.preempt

        def allocate_(seq: Sequence) -> None:
            before = self._index()
            allocate(seq)
            rid, cached = self.rid[seq.seq_id], seq.num_cached_tokens // seq.block_size
            self.events.append(("schedule", rid, len(seq) - seq.num_cached_tokens, 0))
            self.events.append(("hit", rid, tuple(b + 1 for b in seq.block_table[:cached])))
            self.events += [("alloc", rid, b + 1) for b in seq.block_table[cached:]]
            self.events += self._registrations(seq, before)

        def may_append_(seq: Sequence) -> None:
            before, table = self._index(), len(seq.block_table)
            may_append(seq)
            rid = self.rid[seq.seq_id]
            self.events.append(("schedule", rid, 1, 0))
            self.events += [("alloc", rid, b + 1) for b in seq.block_table[table:]]
            self.events += self._registrations(seq, before)

        def deallocate_(seq: Sequence) -> None:
            blocks, before = list(seq.block_table), self._index()
            deallocate(seq)
            self.events += [("free", b + 1) for b in reversed(blocks)]
            self.events += [("unpublish", b + 1) for _, b in sorted(before - self._index())]
            if seq.status == SequenceStatus.FINISHED:
                stopped = not seq.ignore_eos and seq.last_token == 0
                reason = "stop" if stopped else "length"
                self.events.append(("finish", self.rid[seq.seq_id], reason))

        def preempt_(seq: Sequence) -> None:
            self.events.append(("preempt", self.rid[seq.seq_id]))
            preempt(seq)

        manager.allocate = allocate_
        manager.may_append = may_append_
        manager.deallocate = deallocate_
        scheduler.preempt = preempt_
