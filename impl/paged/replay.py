"""Replay a plan on real tensors and compare every attention output with dense attention.

The plan (``records``: ``Fill`` and ``Executed``, built from a trace by
``kvspec.conformance.plan``) says which blocks each step writes and reads. The replay keeps a
paged KV cache (``kv_cache.KVCache``) for a toy model whose K/V and queries are functions of the
token prefix (``model.ToyModel``), so the right K/V of every position is known:

* ``Fill(block)``: the block is fresh garbage: every layer's K and V there become NaN.
* ``Executed``: per layer, first every write of the batch (each entry's positions
  ``start .. end - 1``; a load copies in the right K/V, a failed load writes nothing; above
  layer 0 a computing entry writes K/V made from its own attention output below, wrong if that
  read was), then every read (paged attention of each computing entry's queries over its
  context through its block table, one kernel launch for the whole batch). Each output whose
  result is used (``live``) is compared with the dense forward pass over the request's true
  prefix, computed from scratch.

The first output off by more than the dtype's tolerance is a ``Mismatch``; the blocks to blame
are found by comparing the cache's K/V at each position of the context with the true K/V, and a
block that was read as a prefix it never held (since its last allocation) is a *zombie*.

Several KV-cache groups (``records.GroupLayout``, one per group, from the trace's
``model.groups``): layer ``i`` belongs to group ``i % G`` and reads and writes through that
group's tables (``Work.blocks`` for group 0, ``Work.groups`` for the others), in that group's own
paged cache over the shared block ids (``B_g`` slots a block). A window group's layers attend
over the last ``W`` keys (the kernels' sliding-window option), so its blocks before the window,
nulled or recycled, are never read (they hold NaN: a read would show); the dense pass uses the
same window. A state group's layers run the toy recurrence (``model``): a step starts from the
sum in the state block of the position it starts at (before anything of the step is written)
and writes the sum after its last token to the block of the position it ends at; a state read
wrong is blamed on its block.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .batch import Batch, make_batch
from .kv_cache import KVCache
from .mismatch import BadBlock, Mismatch, Result
from .model import LAYER_KINDS, Dense, Layer, ToyModel
from .records import Executed, Fill, GroupLayout, Record, Work

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 0.0),
    torch.float16: (1.5e-2, 1e-2),  # vLLM's attention tests use these for both 16-bit types
    torch.bfloat16: (1.5e-2, 1e-2),
}
"""(atol, rtol) per storage dtype: ``|out - dense| <= atol + rtol * |dense|``."""

BACKENDS = ("triton", "torch")
NAN = float("nan")


def use_interpreter_without_gpu() -> None:
    """On a machine without CUDA, make Triton's CPU interpreter the runtime: only effective
    before ``triton`` is first imported, and only when ``TRITON_INTERPRET`` is not set."""
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Options:
    backend: str = "triton"
    dtype: torch.dtype = torch.float32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    device: str | None = None
    """None: cuda when available, else cpu."""
    seed: int = 0
    dense_cache: int = 256
    """Dense passes the toy model keeps (by prefix) to extend: lower it for long contexts on a
    GPU, where one pass holds every layer's Q, K, V and outputs."""


def replay(
    plan: Iterable[Record],
    num_blocks: int,
    block_size: int,
    options: Options = Options(),
    groups: Sequence[GroupLayout] = (),
) -> Result:
    """Run the plan; stop at the first mismatch. ``groups``: the trace's KV-cache groups (empty:
    one full-attention group of ``block_size``)."""
    return Replayer(num_blocks, block_size, options, groups).run(plan)


class Replayer:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        options: Options,
        groups: Sequence[GroupLayout] = (),
    ) -> None:
        if options.backend not in BACKENDS:
            raise ValueError(f"unknown backend {options.backend!r}; one of {', '.join(BACKENDS)}")
        if options.dtype not in TOLERANCES:
            raise ValueError(f"unsupported dtype {options.dtype}")
        self.groups = tuple(groups) or (GroupLayout("full", block_size),)
        self.layer_group, self.local = layer_groups(options.num_layers, self.groups)
        if self.groups[0].block_size != block_size:
            raise ValueError(f"group 0's block size is not the trace's {block_size}")
        self.options = options
        self.block_size = block_size
        device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device, self.dtype = torch.device(device), options.dtype
        self.model = ToyModel(
            options.num_layers,
            options.num_heads,
            options.num_kv_heads,
            options.head_dim,
            options.seed,
            cache_size=options.dense_cache,
            layers=[Layer(self.groups[g].kind, self.groups[g].window) for g in self.layer_group],
            device=device,
        )
        self.caches: list[KVCache | None] = []
        """Per attention group: the K/V of its layers, ``B_g`` slots a block."""
        self.states: list[list[torch.Tensor]] = []
        """Per state group, per layer of it: ``[num_blocks, num_kv_heads, head_dim]`` float32
        sums (a state layer keeps its state in float32 whatever the K/V storage, as Mamba's)."""
        self.written: list[np.ndarray] = []
        """Per group, per slot (a state group: per block), the prefix hash of what was last
        written there (0: nothing since alloc)."""
        for g, layout in enumerate(self.groups):
            count = self.layer_group.count(g)
            shape = (num_blocks, options.num_kv_heads, options.head_dim)
            if layout.kind == "state":
                self.caches.append(None)
                self.states.append([torch.full(shape, NAN, device=device) for _ in range(count)])
                self.written.append(np.zeros(num_blocks, dtype=np.uint64))
                continue
            cache = KVCache.allocate(
                count,
                num_blocks,
                layout.block_size,
                options.num_kv_heads,
                options.head_dim,
                options.dtype,
                device,
            )
            self.caches.append(cache)
            self.states.append([])
            self.written.append(np.zeros((num_blocks, layout.block_size), dtype=np.uint64))
        self.write, self.attend = _backend(options.backend, device)
        self.atol, self.rtol = TOLERANCES[options.dtype]

    @property
    def cache(self) -> KVCache:
        """Group 0's paged cache (the one cache of a model without groups)."""
        cache = self.caches[0]
        assert cache is not None
        return cache

    def run(self, plan: Iterable[Record]) -> Result:
        result = Result()
        for record in plan:
            if isinstance(record, Fill):
                self.fill(record.block)
            elif isinstance(record, Executed):
                result.steps += 1
                error, mismatch = self.execute(record, result)
                result.step_errors.append((record.step, error))
                if mismatch is not None:
                    result.mismatch = mismatch
                    break
                result.max_error = max(result.max_error, error)
        return result

    def fill(self, block: int) -> None:
        """A block was allocated (to some group: ids are global): garbage in every group."""
        for cache, states, written in zip(self.caches, self.states, self.written, strict=True):
            if cache is not None:
                cache.fill(block)
            for state in states:
                state[block] = NAN
            written[block] = 0

    def execute(self, step: Executed, result: Result) -> tuple[float, Mismatch | None]:
        dev = self.device
        writers = [w for w in step.work if not w.failed]
        readers = [w for w in step.work if not w.load]
        dense = {w.req: self.model.forward(w.tokens) for w in step.work}
        slots: dict[int, torch.Tensor] = {}
        batches: dict[int, Batch] = {}
        state_reads: dict[tuple[int, int], tuple[int, int, int]] = {}
        """(request, state group) -> (table index, block, hash held) of the state it starts
        from, as it stands before the step writes anything."""
        for g, layout in enumerate(self.groups):
            bsz = layout.block_size
            if layout.kind == "state":
                for w in readers:
                    if w.start > 0:
                        index = -(-w.start // bsz) - 1
                        block = table(w, g)[index]
                        state_reads[w.req, g] = (index, block, int(self.written[g][block]))
                for w in writers:
                    self.written[g][table(w, g)[-1]] = dense[w.req].hashes[w.end - 1]
                continue
            slots[g] = torch.tensor(
                [_slot(table(w, g), p, bsz) for w in writers for p in range(w.start, w.end)],
                dtype=torch.long,
                device=dev,
            )
            batches[g] = make_batch(
                [w.end - w.start for w in readers],
                [w.end for w in readers],
                [table(w, g) for w in readers],
                bsz,
                dev,
            )
            for w in writers:  # bookkeeping: whose K/V each slot holds once this step wrote it
                hashes, tab = dense[w.req].hashes, table(w, g)
                for p in range(w.start, w.end):
                    self.written[g][tab[p // bsz], p % bsz] = hashes[p]
        below: dict[int, torch.Tensor] = {}
        read_states: dict[tuple[int, int], torch.Tensor] = {}
        """(request, layer) -> the sum a state layer started from."""
        worst = 0.0
        for layer in range(self.options.num_layers):
            g = self.layer_group[layer]
            kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for w in writers:
                d = dense[w.req]
                if layer == 0 or w.load:
                    kv[w.req] = d.k[layer][w.start : w.end], d.v[layer][w.start : w.end]
                else:
                    kv[w.req] = self.model.kv_above(layer, d.hashes[w.start : w.end], below[w.req])
            if self.groups[g].kind == "state":
                outs = self.run_state(layer, readers, writers, dense, kv, state_reads, read_states)
            else:
                outs = self.run_attention(layer, readers, writers, dense, kv, slots[g], batches[g])
            for w in readers:
                got = outs[w.req]
                below[w.req] = got
                if not w.live:
                    continue
                want = dense[w.req].o[layer][w.start : w.end]
                diff = (got - want).abs()
                bad = ~(diff <= self.atol + self.rtol * want.abs())  # NaN is bad
                worst = max(worst, float(diff[~bad].max()) if (~bad).any() else 0.0)
                if bad.any():
                    rows = bad.flatten(1).any(1).nonzero().flatten()
                    first, last = w.start + int(rows[0]), w.start + int(rows[-1])
                    error = float("nan") if got.isnan().any() else float(diff.max())
                    blocks = self.blame(w, dense[w.req], layer, state_reads, read_states)
                    return worst, Mismatch(
                        step.step,
                        step.event_index,
                        w.req,
                        layer,
                        error,
                        (first, last),
                        blocks,
                        self.describe(g) if len(self.groups) > 1 else "",
                    )
        result.queries += sum(w.end - w.start for w in readers if w.live)
        return worst, None

    def run_attention(
        self,
        layer: int,
        readers: list[Work],
        writers: list[Work],
        dense: dict[int, Dense],
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
        batch: Batch,
    ) -> dict[int, torch.Tensor]:
        """An attention layer: every write of the batch, then every read (one launch); each
        reader's output, float32."""
        g, local = self.layer_group[layer], self.local[layer]
        cache = self.caches[g]
        assert cache is not None
        dev, dtype = self.device, self.dtype
        if writers:
            key = torch.cat([kv[w.req][0] for w in writers]).to(device=dev, dtype=dtype)
            value = torch.cat([kv[w.req][1] for w in writers]).to(device=dev, dtype=dtype)
            self.write(key, value, cache.k[local], cache.v[local], slots)
        if not readers:
            return {}
        q = torch.cat([dense[w.req].q[layer][w.start : w.end] for w in readers])
        out = self.attend(
            q.to(device=dev, dtype=dtype),
            cache.k[local],
            cache.v[local],
            batch,
            window=self.groups[g].window,
        )
        outs, row = {}, 0
        for w in readers:
            outs[w.req] = out[row : row + w.end - w.start].float()
            row += w.end - w.start
        return outs

    def run_state(
        self,
        layer: int,
        readers: list[Work],
        writers: list[Work],
        dense: dict[int, Dense],
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        state_reads: dict[tuple[int, int], tuple[int, int, int]],
        read_states: dict[tuple[int, int], torch.Tensor],
    ) -> dict[int, torch.Tensor]:
        """A state layer: every read of a state first (a step never starts from a state its own
        batch writes), then each reader's recurrence from it, then every write (a load writes
        the true state); each reader's output."""
        g = self.layer_group[layer]
        states = self.states[g][self.local[layer]]
        for w in readers:
            if w.start > 0:
                read_states[w.req, layer] = states[state_reads[w.req, g][1]].clone()
        outs, finals = {}, {}
        for w in readers:
            sums = self.model.state_sums(read_states.get((w.req, layer)), kv[w.req][1])
            q = dense[w.req].q[layer][w.start : w.end]
            outs[w.req] = self.model.state_output(sums, q, w.start)
            finals[w.req] = sums[-1]
        for w in writers:
            final = dense[w.req].s[layer][w.end - 1] if w.load else finals[w.req]  # type: ignore[index]
            states[table(w, g)[-1]] = final
        return outs

    def describe(self, g: int) -> str:
        layout = self.groups[g]
        what = f"window {layout.window}" if layout.kind == "window" else layout.kind
        return f"group {g}: {what}"

    def blame(
        self,
        w: Work,
        dense: Dense,
        layer: int,
        state_reads: dict[tuple[int, int], tuple[int, int, int]],
        read_states: dict[tuple[int, int], torch.Tensor],
    ) -> tuple[BadBlock, ...]:
        """The reader's blocks, in every group, that hold something wrong where the step reads:
        K or V differing from the truth at a position its queries see (the whole context for
        full attention, the windows of its queries for a window), or a state differing from
        the recurrence over the prefix it starts after. Layers ``0 .. layer`` (run this step)
        are checked over the whole context, the layers above it over what earlier steps wrote
        (the positions before the step's start), so a zombie of every group is named."""
        blocks: list[BadBlock] = []
        for g, layout in enumerate(self.groups):
            layers = [lay for lay in range(self.options.num_layers) if self.layer_group[lay] == g]
            if layout.kind == "state":
                blocks += self._blame_state(w, dense, g, layers, state_reads, read_states)
            else:
                blocks += self._blame_kv(w, dense, g, layers, layer)
        return tuple(blocks)

    def _blame_kv(
        self, w: Work, dense: Dense, g: int, layers: list[int], done: int
    ) -> list[BadBlock]:
        layout, cache, tab = self.groups[g], self.caches[g], table(w, g)
        assert cache is not None
        bsz = layout.block_size
        first = max(0, w.start - layout.window + 1) if layout.kind == "window" else 0
        wrong = torch.zeros(w.end, dtype=torch.bool)
        for lay in layers:
            upto = w.end if lay <= done else w.start
            if upto <= first:
                continue
            slots = torch.tensor([_slot(tab, p, bsz) for p in range(first, upto)])
            k_slots, v_slots = cache.slots(self.local[lay])
            for held, truth in ((k_slots, dense.k[lay]), (v_slots, dense.v[lay])):
                have = held[slots.to(held.device)].float().cpu()
                want = truth[first:upto].to(self.dtype).float().cpu()
                ok = (have - want).abs() <= self.atol + self.rtol * want.abs()
                wrong[first:upto] |= ~ok.flatten(1).all(1)
        blocks = []
        for index, block in enumerate(tab):
            positions = [
                p
                for p in range(max(first, index * bsz), min(w.end, (index + 1) * bsz))
                if bool(wrong[p])
            ]
            if not positions:
                continue
            held_hashes = [int(self.written[g][block, p % bsz]) for p in positions]
            zombie = any(h != dense.hashes[p] for h, p in zip(held_hashes, positions, strict=True))
            never = all(h == 0 for h in held_hashes)
            span = (positions[0], positions[-1])
            blocks.append(BadBlock(block, index, span, zombie, never, g, layout.kind))
        return blocks

    def _blame_state(
        self,
        w: Work,
        dense: Dense,
        g: int,
        layers: list[int],
        state_reads: dict[tuple[int, int], tuple[int, int, int]],
        read_states: dict[tuple[int, int], torch.Tensor],
    ) -> list[BadBlock]:
        """The state block the step starts from, when a layer read (or, above the mismatch,
        would read: nothing of the step is written there yet) a sum off the truth."""
        if w.start == 0:
            return []
        index, block, held = state_reads[w.req, g]
        for lay in layers:
            have = read_states.get((w.req, lay))
            if have is None:
                have = self.states[g][self.local[lay]][block]
            want = dense.s[lay][w.start - 1]  # type: ignore[index]
            tolerance = self.atol + max(self.rtol, 1e-5) * want.abs()
            if not bool(((have - want).abs() <= tolerance).all()):
                zombie = held != dense.hashes[w.start - 1]
                boundary = (w.start, w.start)
                return [BadBlock(block, index, boundary, zombie, held == 0, g, "state")]
        return []


def table(w: Work, g: int) -> tuple[int, ...]:
    """The work's table prefix in group ``g``."""
    return w.blocks if g == 0 else w.groups[g - 1]


def layer_groups(
    num_layers: int, groups: Sequence[GroupLayout]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Layer ``i`` belongs to group ``i % G``: each layer's group, and its index among the
    group's layers. ValueError when a group would have no layer or a layout is bad."""
    if len(groups) > num_layers:
        raise ValueError(
            f"{len(groups)} KV-cache groups need at least {len(groups)} layers "
            "(layer i belongs to group i % G)"
        )
    for g, layout in enumerate(groups):
        if layout.kind not in LAYER_KINDS or layout.block_size < 1:
            raise ValueError(f"group {g}: cannot replay {layout}")
        if (layout.kind == "window") != (layout.window > 0):
            raise ValueError(f"group {g}: a window needs kind window, and only it ({layout})")
    owner = tuple(i % len(groups) for i in range(num_layers))
    local = tuple(owner[:i].count(owner[i]) for i in range(num_layers))
    return owner, local


def _slot(blocks: tuple[int, ...], position: int, block_size: int) -> int:
    return blocks[position // block_size] * block_size + position % block_size


def _backend(
    name: str, device: str | torch.device
) -> tuple[Callable[..., None], Callable[..., torch.Tensor]]:
    if name == "torch":
        from .attention_ref import paged_attention_ref, write_kv_ref

        return write_kv_ref, paged_attention_ref
    from . import kernels

    if not str(device).startswith("cuda") and not kernels.interpreting():
        raise ValueError(
            "the triton backend needs a CUDA device, or TRITON_INTERPRET=1 set before triton "
            "is imported"
        )
    return kernels.write_kv, kernels.paged_attention
