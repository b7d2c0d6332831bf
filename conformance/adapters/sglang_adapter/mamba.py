"""The MAMBA component of SGLang's ``UnifiedRadixCache`` (a hybrid linear-attention model: FULL
and MAMBA on one radix tree, no extra buffer) as the events of two KV-cache groups: group 0 the
FULL pool's pages, group 1 (the spec's ``slot`` kind, one state per slot, block size 1) the
``MambaPool``'s slots.

SGLang keeps one recurrent state per slot of ``HybridReqToTokenPool.mamba_pool``; slot 0 is its
padding target, slots 1..M are handed out by ``MambaSlotAllocator``. A running request owns one
slot (``req.kv.mamba_pool_idx``) that every forward reads and rewrites. The tree keeps states as
the MAMBA value of a node (one slot, the state after the node's whole key), and moves them by
copy (``MambaComponent``, ``no_buffer``):

* a hit copies the matched node's state into the request's own slot (copy-on-write:
  ``finalize_match_result_in_cache`` sets ``mamba_cow_src_index``; the forward stream copies it,
  ``ScheduleBatch._collect_deferred_mamba_cow_and_clear``): ``hit (src,)`` then ``alloc slot``;
* an insert of a running request copies its slot into a fresh slot the tree keeps
  (``prepare_for_caching_req``, ``is_finished=False``): ``snapshot r i b``, ``i + 1`` the key's
  length; when the node already has a state (``mamba_exist``) SGLang frees the copy and nothing
  became visible: no event (and an eviction that made room for it is an ``unpublish``);
* a finished request donates its own slot (``is_finished=True``): ``snapshot r i slot``, then the
  table's ``free`` as for any block (the slot stays in the tree, refcount 0); a state the tree
  already has makes SGLang free the slot (``free_mamba_cache``): the ``free`` alone.

Block ids are global (one id space, as for SWA, ``swa.py``): FULL pages keep 1..F, MAMBA slot
``q`` (1..M) is block ``F + q``. A tree state's refcount is the number of requests whose tree lock
sits on its node (``MambaComponent.acquire_component_lock`` locks that node's state only); a
request's own slot counts 1.

The model (``MAMBA_MODEL``) is LFM2's layout, a hybrid of short-convolution (state) layers and
full-attention ones: SGLang's ``auto`` strategy resolves it to ``no_buffer`` and forces
``disable_overlap_schedule`` (``arg_groups/overrides.py``, ``_mamba_radix_cache_resolution``): the
loop without overlap, depth 1. A model with the ping-pong ``extra_buffer`` (``EXTRA_MODEL``,
Qwen3-Next, which ``auto`` resolves to ``extra_buffer`` under overlap: ``extra_resolved``) is
``extra.py``'s (the spec's side is ``spec/tracks.py``).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections import Counter
from typing import Any

from .build import (
    MAX_CONTEXT,
    ComponentType,
    PagedTokenToKVPoolAllocator,
    Req,
    UnifiedRadixCache,
    _create,
    torch,
)
from .record import Event, UnifiedRecorder, rid

MAMBA_GROUP = 1
"""The MAMBA component's group (FULL is group 0: ``create_unified_radix_cache`` lists it first)."""

MAMBA_MODEL = {
    "architectures": ["Lfm2ForCausalLM"],
    "model_type": "lfm2",
    "num_hidden_layers": 2,
    "layer_types": ["conv", "full_attention"],
    "hidden_size": 4,
    "intermediate_size": 8,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "conv_L_cache": 2,
    "vocab_size": 4,
    "max_position_embeddings": MAX_CONTEXT,
}
"""The ``config.json`` of a tiny hybrid linear-attention model (LFM2's layout: a short-convolution
layer, whose state SGLang keeps in its ``MambaPool``, beside a full-attention layer), no weights:
SGLang's ``ModelConfig`` and ``mambaish_config`` read from it the state's shape and layers."""

EXTRA_MODEL = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 1,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "vocab_size": 256,
    "max_position_embeddings": MAX_CONTEXT,
    "mamba_chunk_size": 2,
}
"""The ``config.json`` of a tiny Qwen3-Next (a gated-delta-net layer beside a full-attention one),
no weights: the model SGLang's ``auto`` resolves to ``extra_buffer`` under the overlap loop
(``extra_resolved``; spec side: ``docs/model.md``, "Track slots"). ``mamba_chunk_size`` 2 (read by
SGLang's ``mamba_cache_chunk_size`` in place of the FLA kernel's 64): a state checkpoint every 2
tokens, so that a cell of a few dozen tokens tracks, donates and hits states (``extra.py``)."""

MODELS = {"lfm2": MAMBA_MODEL, "qwen3-next": EXTRA_MODEL}
"""The hybrid SSM models the adapter writes, by name."""


@functools.cache
def model_folder(model: str = "lfm2") -> str:
    """A temporary folder holding ``MODELS[model]`` as its ``config.json``."""
    folder = tempfile.mkdtemp(prefix=f"kvspec-sglang-{model}-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(MODELS[model], f)
    return folder


def extra_resolved(disable_overlap: bool = False) -> tuple[tuple[str, Any], ...]:
    """``resolved`` for ``EXTRA_MODEL`` (Qwen3-Next)."""
    return resolved(disable_overlap, "qwen3-next")


@functools.cache
def resolved(disable_overlap: bool = False, model: str = "lfm2") -> tuple[tuple[str, Any], ...]:
    """What SGLang's own resolution pass (``_mamba_radix_cache_resolution``) decides for
    ``MODELS[model]`` with the server's default arguments on a CPU
    (``--disable-overlap-schedule`` with ``disable_overlap``): ``mamba_radix_cache_strategy``
    from ``auto``, and whether it forces ``disable_overlap_schedule``."""
    from sglang.srt.arg_groups import overrides
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_folder(model),
        device="cpu",
        skip_tokenizer_init=True,
        disable_overlap_schedule=disable_overlap,
    )
    view = overrides.ResolvedView(args, overlay=overrides._declaration_overlay(args))
    return tuple(sorted(overrides._mamba_radix_cache_resolution(view).items()))


@functools.cache
def state_model(model: str = "lfm2") -> Any:
    """SGLang's ``mambaish_config`` of ``MODELS[model]`` (``configs/hybrid_arch.py``): the state's
    cache parameters (``mamba2_cache_params``) and layers."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_folder(model), device="cpu", skip_tokenizer_init=True)
    config = mambaish_config(ModelConfig.from_server_args(args))
    if config is None:
        raise RuntimeError(f"SGLang does not take the {model} model for a hybrid SSM model")
    return config


def slots_for(rows: int, extra: bool = False) -> int:
    """``max_mamba_cache_size`` for ``rows`` running requests, as SGLang sizes them: 3 state slots
    per request (``MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO``, no_buffer: its own slot, the
    tree state its lock holds, and a fresh copy at an insert); with ``extra`` (``extra_buffer``
    under overlap) 2 more, its ping-pong track slots (``_calculate_mamba_ratio``,
    ``get_mamba_tracking_slots``)."""
    from sglang.srt.mem_cache.allocation_sizing import get_mamba_tracking_slots
    from sglang.srt.mem_cache.kv_cache_configurator import (
        MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO,
    )

    tracking = get_mamba_tracking_slots(extra_buffer=extra, overlap=True) if extra else 0
    return (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO + tracking) * rows


def mamba_memory(page_size: int, pages: int, slots: int, rows: int) -> tuple[Any, Any, Any]:
    """``memory`` for ``MAMBA_MODEL``, as SGLang builds it (``kv_cache_configurator``'s
    ``_build_hybrid_req_pool``: a ``HybridReqToTokenPool`` with ``slots`` state slots, its
    ``MambaPool`` on the CPU, no extra buffer, no overlap; a ``PagedTokenToKVPoolAllocator`` over
    ``pages`` full pages; ``create_tree_cache`` with ``is_hybrid_ssm``): a ``UnifiedRadixCache``
    with FULL and MAMBA."""
    strategy = dict(resolved())
    if strategy.get("mamba_radix_cache_strategy") != "no_buffer":
        raise RuntimeError(f"SGLang resolves MAMBA_MODEL to {strategy}, not no_buffer")
    return hybrid_memory(state_model(), page_size, pages, slots, rows, extra=False)


def hybrid_memory(
    config: Any, page_size: int, pages: int, slots: int, rows: int, extra: bool
) -> tuple[Any, Any, Any]:
    """SGLang's objects for a hybrid SSM model ``config`` (``state_model``): the
    ``HybridReqToTokenPool`` (``extra``: with its ping-pong track buffers and the overlap loop,
    as ``extra_buffer`` builds it; else neither) and ``create_tree_cache``'s ``UnifiedRadixCache``
    with FULL and MAMBA (checked: ``extra`` also checks the tree's extra buffer and a ping-pong
    pair). Shared by ``mamba_memory`` and ``extra.extra_memory``."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    pool = HybridReqToTokenPool(
        size=rows,
        mamba_size=slots,
        mamba_spec_state_size=rows,
        max_context_len=MAX_CONTEXT,
        device="cpu",
        enable_memory_saver=False,
        cache_params=config.mamba2_cache_params,
        mamba_layer_ids=list(config.mamba2_cache_params.layers),
        enable_mamba_extra_buffer=extra,
        enable_overlap_schedule=extra,
    )
    allocator = PagedTokenToKVPoolAllocator(
        pages * page_size, page_size, torch.float32, "cpu", None, need_sort=False
    )
    cache = _create(pool, allocator, page_size, "unified", None, None, ssm=True, extra=extra)
    wanted = {ComponentType.FULL, ComponentType.MAMBA}
    if not isinstance(cache, UnifiedRadixCache) or set(cache.components) != wanted:
        raise RuntimeError(
            f"SGLang's create_tree_cache built {type(cache).__name__} with "
            f"{sorted(c.name for c in getattr(cache, 'components', {}))}, not FULL and MAMBA"
        )
    if extra and (
        not cache.enable_mamba_extra_buffer or pool.mamba_ping_pong_track_buffer_size != 2
    ):
        raise RuntimeError("SGLang's create_tree_cache built no extra_buffer ping-pong pair")
    return pool, allocator, cache


class MambaRecorder(UnifiedRecorder):
    """``UnifiedRecorder`` over a tree with FULL and MAMBA: every view covers both groups, MAMBA
    slots as global ids ``full_pages + q``; an insert's new state is a ``snapshot`` in group 1
    at the key's last token, an eviction of either value reported like any eviction."""

    def __init__(
        self, tree: Any, pool: Any, page_size: int, events: list[Event], full_pages: int
    ) -> None:
        self.full_pages = full_pages
        self.state_index: dict[int, int] = {}
        """Per tree state (global id): the position of its key's last token (``snapshot``'s i)."""
        self.cow: dict[int, int | None] = {}
        """Per request admitted this batch: the tree state its slot is copied from (global id)."""
        self.paths: Counter[str] = Counter()
        """How often the hybrid paths ran: the coverage a fuzz run reports
        (``bench/fuzz_sglang_coverage.py --mamba``)."""
        super().__init__(tree, pool, page_size, events)

    # -- ids ------------------------------------------------------------------------------------

    def block(self, slot: Any) -> int:
        return self.full_pages + int(slot)

    def group_of(self, block: int) -> int:
        return MAMBA_GROUP if block > self.full_pages else 0

    # -- views ----------------------------------------------------------------------------------

    def tables(self, req: Req) -> list[list[int]]:
        """The request's FULL row and its own state slot (none before it is scheduled, or once
        released)."""
        own = [self.block(req.kv.mamba_pool_idx)] if req.kv.holds_mamba else []
        return [self.row(req), own]

    def states(self) -> set[int]:
        """The tree's states (global ids): ``TreeCore.all_mamba_values_flatten``."""
        values = self.tree.tree_core.all_mamba_values_flatten().tolist()
        return {self.block(v) for v in values}

    def locked_states(self, holders: list[Req]) -> Counter[int]:
        """Per tree state, the requests whose tree lock sits on its node."""
        out: Counter[int] = Counter()
        for req in holders:
            lock = getattr(req, "lock", None)
            if lock is None:
                continue
            value = self.tree.tree_core.get_component_device_value(lock.node, ComponentType.MAMBA)
            if value is not None:
                out[self.block(value.view(-1)[0])] += 1
        return out

    def cached_pages(self) -> dict[int, int]:
        out = self._walk(False)
        for block in self.states():
            out[block] = self.state_index.get(block, -1)
        return out

    def page_values(self) -> dict[int, int]:
        return self._walk(False)

    def unlocked(self) -> set[int]:
        """The tree's unlocked FULL pages and every tree state: a hit copies a state and takes
        no reference, so the spec counts none (SGLang's lock on the state at a request's lock
        node, ``locked_states``, guards a state the request never reads again)."""
        return set(self._walk(True)) | self.states()

    def locks(self) -> dict[int, int] | None:
        return None  # the Rust core's FULL lock counts are out of Python's reach

    def free_pages(self) -> set[int]:
        """The FULL allocator's free pages and the free state slots, as global ids."""
        full = self.tree.token_to_kv_pool_allocator.get_all_free_pages().tolist()
        slots = self.pool.mamba_allocator.free_slots.tolist()
        return {int(p) for p in full} | {self.block(q) for q in slots}

    # -- admission ------------------------------------------------------------------------------

    def note_cow(self, reqs: list[Req]) -> None:
        """Before ``prepare_for_extend`` (which hands the copy to the forward and clears
        ``mamba_cow_src_index``): each admitted request's copy source."""
        self.cow = {
            rid(r): (
                None if r.kv.mamba_cow_src_index is None else self.block(r.kv.mamba_cow_src_index)
            )
            for r in reqs
        }

    def admitted(self, req: Req, tables: list[list[int]], hit: int) -> list[list[int]]:
        """The tables of an admission's ``hit``: the FULL prefix, and the state its slot is
        copied from (none when no state was hit)."""
        src = self.cow.get(rid(req))
        self.paths["admissions"] += 1
        if src is not None:
            self.paths["states hit by copy"] += 1
        elif hit:
            self.paths["FULL hits without a state"] += 1
        return [tables[0][:hit], [src] if src is not None else []]

    # -- reporting ------------------------------------------------------------------------------

    def state_inserted(self, req: Req, index: int, block: int) -> None:
        """A new tree state ``block`` at ``index``, inserted by ``req``: its ``snapshot``
        (``extra.py`` reports a donation of a track slot later, in the order the spec takes)."""
        own = req.kv.holds_mamba and self.block(req.kv.mamba_pool_idx) == block
        self.paths["snapshots by donation" if own else "snapshots by copy"] += 1
        self.events.append(("snapshot", rid(req), index, block, MAMBA_GROUP))

    def _publish(self, index: int, page: int) -> None:
        req = self.acting
        if req is None:
            raise AssertionError("SGLang inserted into its tree outside a request's insert")
        self.events.append(("publish", rid(req), index, page))

    def report_leftover(self) -> None:
        """After an insert or release: what its evictions left free (``unpublish``)."""
        evicted, self.evicted = self.evicted, []
        self.events += [("unpublish", page) for page in evicted]

    def _wrap(self) -> None:
        super()._wrap()
        tree = self.tree
        insert, evict = tree.insert, tree._evict  # UnifiedRecorder's wrappers

        def insert_(params: Any) -> Any:
            before = self.states()
            result = insert(params)
            after = self.states()
            req = self.acting
            index = len(params.key) - 1
            self.events += [("unpublish", b) for b in sorted(before - after)]
            for block in sorted(after - before):
                if block in self.evicted:  # the copy's slot, freed by an eviction for it
                    self.evicted.remove(block)
                    self.events.append(("evict", block))
                if req is None:
                    raise AssertionError("SGLang inserted a state outside a request's insert")
                self.state_index[block] = index
                self.state_inserted(req, index, block)
            if params.mamba_value is not None and not (after - before):
                self.paths["states already cached (copy dropped)"] += 1
            return result

        def evict_(*args: Any, **kw: Any) -> Any:
            before = self.states()
            result = evict(*args, **kw)
            gone = sorted(before - self.states())
            self.paths["state evictions"] += len(gone)
            self.evicted += gone
            for block in gone:
                self.state_index.pop(block, None)
            return result

        tree.insert = insert_
        tree._evict = evict_
