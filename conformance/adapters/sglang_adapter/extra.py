"""SGLang 0.5.23's MAMBA component under ``extra_buffer`` (``mamba.EXTRA_MODEL``, Qwen3-Next, as
``auto`` resolves it under the overlap loop) as the events of the spec's track slots
(``docs/model.md``, "Track slots"; ``spec/tracks.py``).

Why a module of its own: ``mamba.py`` reports ``no_buffer``, where a request owns one state slot
and the tree takes copies; here each request also holds a ping-pong pair of *track slots*
(``req.kv.mamba_ping_pong_track_buffer``), a step writes the state at a tracked boundary into
one of them, and an insert *donates* the tracked one to the tree. What SGLang does and what the
adapter reports (global ids: FULL pages 1..F, state slot ``q`` is ``F + q``, as in ``mamba.py``):

* admission (``HybridReqToTokenPool.alloc``, ``_alloc_ping_pong_buffer``): the working slot's
  ``alloc`` (its ``hit`` by copy first, as ``no_buffer``), then one ``alloc`` per ping-pong slot
  in buffer order (the request's slot table: working slot, then the track slots);
* a step that tracks the request (an extend: ``prepare_for_extend``'s
  ``_mamba_radix_cache_v2_req_prepare_for_extend``, ``mamba_prefill_track_mask_cpu``; a decode:
  ``prepare_for_decode``, ``mamba_track_mask_cpu``, the batch's ``seq_lens % mamba_track_grid
  == 0``): ``("track", r, F+slot, t, 1)`` right after the request's allocations, ``slot`` the
  batch's ``mamba_track_indices`` (the ping-pong slot at ``mamba_next_track_idx`` before it
  flips), ``t`` the boundary SGLang records (``mamba_last_track_seqlen`` for an extend, the
  decode's seq_len, which the result sets as ``mamba_last_track_seqlen``), not the kernel's
  ``mamba_track_seqlens``;
* a running insert (``checkpoint_kv_cache`` -> ``prepare_for_caching_req(is_finished=False)``):
  SGLang takes a fresh slot (``_alloc_mamba_slot``) and donates the tracked one
  (``donate_mamba_ping_pong_slot``, the position ``mamba_last_track_idx``), keyed at
  ``mamba_last_track_seqlen``: after the FULL ``publish``es, ``("snapshot", r, L-1, F+donated,
  1)`` then the fresh slot's ``alloc`` (its ``evict`` first when an eviction freed it). Where the
  node has a state already (``mamba_exist``) SGLang frees the donated slot: the same two events,
  then its ``unpublish`` (the slot left the request, went free, and no hit can come between);
* a finish (``release_kv_cache(checkpoint=True)``): the table's ``free``s and the ``finish``,
  then ``("snapshot", r, L-1, F+kept, 1)`` for the slot ``_select_finished_checkpoint`` kept
  (none where SGLang kept none, or the node had a state);
* a decode result: SGLang's own ``_mamba_prefix_cache_update`` flips the ping-pong index
  (``decode_result``).

SGLang's resolution refuses ``extra_buffer`` on a CPU ("requires platform support for Mamba
cache state snapshots", ``mamba_hook._platform_supports_mamba_cache_extra_buffer``): the adapter
answers that one platform question as a CUDA server does, while SGLang resolves its arguments,
and runs every SGLang call of this adapter under that resolved context (``runtime_context``'s
``create_context`` / ``use_context``), so the process's own published settings stay as they
are. ``mamba_track_interval`` is 2 (``TRACK_INTERVAL``) and the model's ``mamba_chunk_size`` 2,
so that a cell of a few dozen tokens tracks: pages of 1 token, as ``mamba.py``'s cells."""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .build import (
    VOCAB,
    Req,
    ScheduleBatch,
    torch,
)
from .loops import SglangAdapter
from .mamba import (
    MAMBA_GROUP,
    MambaRecorder,
    hybrid_memory,
    model_folder,
    slots_for,
    state_model,
)
from .record import Event, rid
from .scheduler import Scheduler

TRACK_INTERVAL = 2
"""``--mamba-track-interval`` (SGLang's default 256): a decode tracks every 2 tokens."""


NOT_BUILT = (
    "the extra_buffer adapter follows SGLang's defaults: mamba_max_states_per_path (a cap on the "
    "states one tree path keeps), the int8 checkpoint pool and ReplaySSM are not built"
)
"""Why ``context`` refuses resolved settings that turn one of them on."""


def _server_args() -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_folder("qwen3-next"),
        device="cpu",
        skip_tokenizer_init=True,
        mamba_track_interval=TRACK_INTERVAL,
    )


@functools.cache
def context() -> Any:
    """SGLang's resolved settings for ``EXTRA_MODEL`` with the server's defaults (overlap on),
    as a ``RuntimeContext`` of their own; checked: ``extra_buffer``, not lazy, overlap kept."""
    from sglang.srt import runtime_context
    from sglang.srt.arg_groups import mamba_hook

    args = _server_args()
    platform = mamba_hook._platform_supports_mamba_cache_extra_buffer
    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True  # a CUDA server's
    try:
        made = runtime_context.create_context(args, role="scheduler")
    finally:
        mamba_hook._platform_supports_mamba_cache_extra_buffer = platform
    with runtime_context.use_context(made):
        mamba = runtime_context.get_exec().mamba
        if not mamba.enable_mamba_extra_buffer or mamba.enable_mamba_extra_buffer_lazy:
            raise RuntimeError(f"SGLang resolves EXTRA_MODEL to {mamba.mamba_radix_cache_strategy}")
        if args.disable_overlap_schedule:
            raise RuntimeError("SGLang turns the overlap loop off for EXTRA_MODEL")
        built = {
            "mamba_max_states_per_path": mamba.mamba_max_states_per_path in (None, -1),
            "int8 checkpoint pool": not mamba.enable_int8_mamba_checkpoint,
            "ReplaySSM": not mamba.enable_linear_replayssm,
        }
        for name, off in built.items():
            if not off:
                raise RuntimeError(f"{NOT_BUILT}: {name} is on")
    return made


@contextmanager
def sglang() -> Iterator[None]:
    """SGLang's calls under ``context()``, with ``Tensor.pin_memory`` the identity (a CUDA
    server pins the decode's host track mask before its copy to the device; on a CPU the copy
    is the tensor itself, and PyTorch refuses to pin without an accelerator)."""
    from sglang.srt import runtime_context

    pin = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, *args, **kw: self  # type: ignore[method-assign]
    try:
        with runtime_context.use_context(context()):
            yield
    finally:
        torch.Tensor.pin_memory = pin  # type: ignore[method-assign]


@functools.cache
def model() -> Any:
    """The ``model_config`` a batch carries: ``build.MODEL`` and Qwen3-Next's ``hf_text_config``
    (``prepare_for_extend`` reads its ``mamba_chunk_size``)."""
    from sglang.srt.configs.model_config import ModelConfig

    text = ModelConfig.from_server_args(_server_args()).hf_text_config
    return types.SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False, hf_text_config=text)


def extra_memory(page_size: int, pages: int, slots: int, rows: int) -> tuple[Any, Any, Any]:
    """``mamba.mamba_memory`` for ``EXTRA_MODEL``: the ``HybridReqToTokenPool`` with its ping-pong
    track buffers (``enable_mamba_extra_buffer``, overlap on) and ``create_tree_cache``'s
    FULL + MAMBA ``UnifiedRadixCache`` with ``extra_buffer`` (checked: ``mamba.hybrid_memory``)."""
    return hybrid_memory(state_model("qwen3-next"), page_size, pages, slots, rows, extra=True)


class ExtraRecorder(MambaRecorder):
    """``MambaRecorder`` with track slots: a request's slot table is its working slot then its
    ping-pong slots; a donation is reported in the spec's order (module docstring)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.inserted: list[tuple[int, int]] = []
        """(index, state) the acting request's insert put in the tree."""
        self.pending: list[Event] = []
        """A running insert's donation, reported after its insert (``report_leftover``)."""
        self.after: list[Event] = []
        """A finished insert's donation, reported after the ``finish`` (``after_finish``)."""
        super().__init__(*args, **kw)

    def track_slots(self, req: Req) -> list[int]:
        buf = req.kv.mamba_ping_pong_track_buffer
        if buf is None or not req.kv.holds_mamba:
            return []
        return [self.block(q) for q in buf.tolist() if q >= 0]

    def tables(self, req: Req) -> list[list[int]]:
        row, own = super().tables(req)
        return [row, own + self.track_slots(req) if own else []]

    def repointed(self, req: Req, group: int, before: list[int], after: list[int]) -> list[Event]:
        """A donation changes the slot table at an insert: reported by ``acting_for``."""
        return [] if group == MAMBA_GROUP else super().repointed(req, group, before, after)

    def tracked(self, batch: ScheduleBatch, index: int, extend: bool) -> list[Event]:
        req = batch.reqs[index]
        mask = batch.mamba_prefill_track_mask_cpu if extend else batch.mamba_track_mask_cpu
        if not mask or not mask[index]:
            return []
        t = req.kv.mamba_last_track_seqlen if extend else int(batch.seq_lens_cpu[index])
        slot = self.block(int(batch.mamba_track_indices[index]))
        self.paths["track writes (extend)" if extend else "track writes (decode)"] += 1
        return [("track", rid(req), slot, int(t), MAMBA_GROUP)]

    def state_inserted(self, req: Req, index: int, block: int) -> None:
        self.inserted.append((index, block))

    @contextmanager
    def acting_for(self, req: Req, finishing: bool = False) -> Iterator[None]:
        before = self.track_slots(req)
        last = req.kv.mamba_last_track_seqlen
        self.inserted = []
        with super().acting_for(req, finishing):
            yield
        inserted, self.inserted = self.inserted, []
        if finishing:
            for index, block in inserted:
                if block not in before:
                    raise AssertionError(f"r{rid(req)} finished and cached {block}, no track slot")
                self.paths["finished donations"] += 1
                self.after.append(("snapshot", rid(req), index, block, MAMBA_GROUP))
            return
        after = self.track_slots(req)
        changed = [(a, b) for a, b in zip(before, after, strict=False) if a != b]
        if not changed:
            if inserted:
                raise AssertionError(f"r{rid(req)} cached a state without donating a track slot")
            return
        ((donated, fresh),) = changed
        if inserted and inserted != [(inserted[0][0], donated)]:
            raise AssertionError(f"r{rid(req)} donated {donated}, the tree took {inserted}")
        index = inserted[0][0] if inserted else int(last) - 1
        self.pending.append(("snapshot", rid(req), index, donated, MAMBA_GROUP))
        if fresh in self.evicted:
            self.evicted.remove(fresh)
            self.pending.append(("evict", fresh))
        self.pending.append(("alloc", rid(req), fresh, MAMBA_GROUP))
        if inserted:
            self.paths["track donations"] += 1
        else:  # mamba_exist: SGLang freed the donated slot
            self.paths["donations dropped (state already cached)"] += 1
            self.pending.append(("unpublish", donated))

    def report_leftover(self) -> None:
        pending, self.pending = self.pending, []
        self.events += pending
        super().report_leftover()

    def after_finish(self) -> list[Event]:
        after, self.after = self.after, []
        return after


class _Results:
    """What SGLang's ``BatchResultProcessor`` reads in its Mamba decode update: the tree."""

    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as _P,
    )

    _mamba_prefix_cache_update = _P._mamba_prefix_cache_update
    _mamba_check_track_boundary = _P._mamba_check_track_boundary
    _mamba_assert_committed_len_lookahead = _P.__dict__["_mamba_assert_committed_len_lookahead"]
    mamba_lazy_post_decode_at_boundary = _P.mamba_lazy_post_decode_at_boundary

    def __init__(self, tree: Any) -> None:
        self.tree_cache = tree


class ExtraScheduler(Scheduler):
    """``Scheduler`` over ``extra_memory`` with ``ExtraRecorder``."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.model = model()
        self.results = _Results(self.tree)

    def state_slots(self, rows: int) -> int:
        return slots_for(rows, extra=True)

    def build_memory(self, tree: str) -> tuple[Any, Any, Any]:
        return extra_memory(self.page_size, self.full_pages, self.slots, self.config.max_running)

    def new_recorder(self) -> ExtraRecorder:
        return ExtraRecorder(self.tree, self.pool, self.page_size, self.events, self.full_pages)

    def tracked(self, batch: ScheduleBatch, index: int, extend: bool) -> list[Event]:
        return self.record.tracked(batch, index, extend)  # type: ignore[attr-defined]

    def after_finish(self, req: Req) -> list[Event]:
        return self.record.after_finish()  # type: ignore[attr-defined]

    def decode_result(self, batch: ScheduleBatch, req: Req) -> None:
        """R 1385-1427, non-lazy, no speculative decoding: the boundary the decode completed
        becomes ``mamba_last_track_seqlen`` (its slot ``mamba_last_track_idx``), then SGLang's
        own ``_mamba_prefix_cache_update`` flips ``mamba_next_track_idx``."""
        i = batch.reqs.index(req)
        known: bool | None = None
        if batch.mamba_track_mask_cpu is not None:
            completed = bool(batch.mamba_track_mask_cpu[i])
            lookahead = req.decode_batch_idx - batch.mamba_decode_batch_idx_cpu[i]
            assert lookahead in (0, 1), f"mamba result lookahead {lookahead} for r{rid(req)}"
            known = completed if lookahead == 0 else bool(batch.mamba_track_mask_next_cpu[i])
            if completed:
                req.kv.mamba_last_track_idx = batch.mamba_track_buffer_indices[i]
                req.kv.mamba_prev_track_seqlen = req.kv.mamba_last_track_seqlen
                req.kv.mamba_last_track_seqlen = req.kv.kv_committed_len - lookahead
        if known is None or known:
            self.results._mamba_prefix_cache_update(
                req, batch, None, i, known_boundary=known is True
            )


class FlippedScheduler(ExtraScheduler):
    """SGLang with the ping-pong flip its non-lazy decode misses (``mamba_extra_fixed_factory``).

    SGLang flips ``mamba_next_track_idx`` for a decode boundary at the result of the decode
    *before* it (``mamba_track_mask_next_cpu``, the ``known_boundary`` path), after the boundary's
    own batch is formed. When the step before the first decode boundary was a prefill (whose
    result path updates no Mamba state), no flip happens: the boundary's slot is then both
    ``mamba_last_track_idx`` and ``mamba_next_track_idx``, so the next boundary writes the slot
    that holds the tracked state, and a request that finishes while that write is in flight
    donates a slot the in-flight step overwrites (``kvspec fuzz`` names it StateAtItsBoundary:
    docs/adapters.md). This scheduler flips at the completed boundary's result where SGLang left
    the two equal, as the lazy mode's guard (R 1408-1416) anticipates, in time for the next
    boundary (the track interval is over 1): every other line is SGLang's."""

    def decode_result(self, batch: ScheduleBatch, req: Req) -> None:
        super().decode_result(batch, req)
        i = batch.reqs.index(req)
        kv = req.kv
        if (
            batch.mamba_track_mask_cpu is not None
            and batch.mamba_track_mask_cpu[i]
            and kv.mamba_ping_pong_track_buffer is not None
            and kv.mamba_next_track_idx == kv.mamba_last_track_idx
        ):
            kv.mamba_next_track_idx = self.pool.get_mamba_ping_pong_other_idx(
                kv.mamba_last_track_idx
            )
            self.record.paths["missed flips made"] += 1  # type: ignore[attr-defined]


class ExtraAdapter(SglangAdapter):
    """``SglangAdapter`` over ``ExtraScheduler`` (``scheduler_class``), every SGLang call under
    ``sglang()``; SGLang's overlap loop (depth 2)."""

    scheduler_class: type[ExtraScheduler] = ExtraScheduler

    def __init__(self, config: Any, choices: Any, test_retract: bool | None = None) -> None:
        with sglang():
            super().__init__(
                config, choices, overlap=True, tree="mamba-extra", test_retract=test_retract
            )

    def new_scheduler(self, config: Any, choices: Any, overlap: bool) -> Scheduler:
        return self.scheduler_class(config, choices, overlap, self.tree, self.test_retract)

    def add_request(self, *args: Any, **kw: Any) -> None:
        with sglang():
            super().add_request(*args, **kw)

    def step(self) -> bool:
        with sglang():
            return super().step()

    def abort(self, rid: int) -> bool:
        with sglang():
            return super().abort(rid)

    def reset_prefix_cache(self) -> bool:
        with sglang():
            return super().reset_prefix_cache()


class FixedAdapter(ExtraAdapter):
    """``ExtraAdapter`` over ``FlippedScheduler``."""

    scheduler_class = FlippedScheduler
