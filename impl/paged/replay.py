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
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from .batch import make_batch
from .kv_cache import KVCache
from .model import Dense, ToyModel
from .records import Executed, Fill, Record, Work

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 0.0),
    torch.float16: (1.5e-2, 1e-2),  # vLLM's attention tests use these for both 16-bit types
    torch.bfloat16: (1.5e-2, 1e-2),
}
"""(atol, rtol) per storage dtype: ``|out - dense| <= atol + rtol * |dense|``."""

BACKENDS = ("triton", "torch")


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


@dataclass(frozen=True)
class BadBlock:
    """A block of the reader's table whose K/V differ from the true K/V of the reader's prefix."""

    block: int
    index: int
    """Its position in the reader's table."""
    positions: tuple[int, int]
    """First and last wrong position."""
    zombie: bool
    """Read as a prefix it never held since its allocation (else: it held the prefix, but its
    K/V were computed from a wrong read)."""
    never_written: bool
    """Nothing was written to the wrong positions since the block's allocation (NaN)."""

    def __str__(self) -> str:
        where = f"block {self.block} (table index {self.index}, positions {self.positions[0]}..{self.positions[1]})"
        if self.zombie and self.never_written:
            return f"{where} is a zombie: read as this prefix, never written since its allocation"
        if self.zombie:
            return f"{where} is a zombie: read as this prefix, it holds another prefix's K/V"
        return f"{where} holds this prefix's K/V computed from a wrong read"


@dataclass(frozen=True)
class Mismatch:
    step: int
    event_index: int
    req: int
    layer: int
    error: float
    positions: tuple[int, int]
    """First and last query position off by more than the tolerance."""
    blocks: tuple[BadBlock, ...]

    def __str__(self) -> str:
        head = (
            f"step {self.step} (event {self.event_index}): r{self.req}, layer {self.layer}, "
            f"queries at positions {self.positions[0]}..{self.positions[1]} "
            + ("give NaN" if self.error != self.error else f"off by {self.error:.3g}")
        )
        if not self.blocks:
            return head + "; every block holds the right K/V: the attention itself is wrong"
        return head + "; " + "; ".join(str(b) for b in self.blocks)


@dataclass
class Result:
    steps: int = 0
    """Executed steps replayed."""
    queries: int = 0
    """Query tokens compared with dense attention (each in every layer)."""
    max_error: float = 0.0
    """Largest absolute difference over every compared output (before any mismatch)."""
    step_errors: list[tuple[int, float]] = field(default_factory=list)
    mismatch: Mismatch | None = None


def replay(
    plan: Iterable[Record], num_blocks: int, block_size: int, options: Options = Options()
) -> Result:
    """Run the plan; stop at the first mismatch."""
    return Replayer(num_blocks, block_size, options).run(plan)


class Replayer:
    def __init__(self, num_blocks: int, block_size: int, options: Options) -> None:
        if options.backend not in BACKENDS:
            raise ValueError(f"unknown backend {options.backend!r}; one of {', '.join(BACKENDS)}")
        if options.dtype not in TOLERANCES:
            raise ValueError(f"unsupported dtype {options.dtype}")
        self.options = options
        self.block_size = block_size
        device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = ToyModel(
            options.num_layers,
            options.num_heads,
            options.num_kv_heads,
            options.head_dim,
            options.seed,
        )
        self.cache = KVCache.allocate(
            options.num_layers,
            num_blocks,
            block_size,
            options.num_kv_heads,
            options.head_dim,
            options.dtype,
            device,
        )
        self.written = np.zeros((num_blocks, block_size), dtype=np.uint64)
        """Per slot, the prefix hash of the K/V last written there (0: nothing since alloc)."""
        self.write, self.attend = _backend(options.backend, device)
        self.atol, self.rtol = TOLERANCES[options.dtype]

    def run(self, plan: Iterable[Record]) -> Result:
        result = Result()
        for record in plan:
            if isinstance(record, Fill):
                self.cache.fill(record.block)
                self.written[record.block] = 0
            elif isinstance(record, Executed):
                result.steps += 1
                error, mismatch = self.execute(record, result)
                result.step_errors.append((record.step, error))
                if mismatch is not None:
                    result.mismatch = mismatch
                    break
                result.max_error = max(result.max_error, error)
        return result

    def execute(self, step: Executed, result: Result) -> tuple[float, Mismatch | None]:
        dev, dtype, bsz = self.cache.device, self.cache.dtype, self.block_size
        writers = [w for w in step.work if not w.failed]
        readers = [w for w in step.work if not w.load]
        dense = {w.req: self.model.forward(w.tokens) for w in step.work}
        slots = torch.tensor(
            [_slot(w.blocks, p, bsz) for w in writers for p in range(w.start, w.end)],
            dtype=torch.long,
            device=dev,
        )
        batch = make_batch(
            [w.end - w.start for w in readers],
            [w.end for w in readers],
            [w.blocks for w in readers],
            bsz,
            dev,
        )
        for w in writers:  # bookkeeping: whose K/V each slot holds once this step wrote it
            hashes = dense[w.req].hashes
            for p in range(w.start, w.end):
                self.written[w.blocks[p // bsz], p % bsz] = hashes[p]
        below: dict[int, torch.Tensor] = {}
        worst = 0.0
        for layer in range(self.cache.num_layers):
            ks, vs = [], []
            for w in writers:
                d = dense[w.req]
                if layer == 0 or w.load:
                    k, v = d.k[layer][w.start : w.end], d.v[layer][w.start : w.end]
                else:
                    k, v = self.model.kv_above(layer, d.hashes[w.start : w.end], below[w.req])
                ks.append(k)
                vs.append(v)
            if writers:
                key = torch.cat(ks).to(device=dev, dtype=dtype)
                value = torch.cat(vs).to(device=dev, dtype=dtype)
                self.write(key, value, self.cache.k[layer], self.cache.v[layer], slots)
            if not readers:
                continue
            q = torch.cat([dense[w.req].q[layer][w.start : w.end] for w in readers])
            out = self.attend(
                q.to(device=dev, dtype=dtype), self.cache.k[layer], self.cache.v[layer], batch
            )
            row = 0
            for w in readers:
                got = out[row : row + w.end - w.start].float().cpu()
                row += w.end - w.start
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
                    blocks = self.blame(w, dense[w.req], layer)
                    return worst, Mismatch(
                        step.step, step.event_index, w.req, layer, error, (first, last), blocks
                    )
        result.queries += sum(w.end - w.start for w in readers if w.live)
        return worst, None

    def blame(self, w: Work, dense: Dense, layer: int) -> tuple[BadBlock, ...]:
        """The reader's blocks whose K or V (in layers ``0 .. layer``) differ from the truth at
        some position of its context ``0 .. end - 1``."""
        bsz = self.block_size
        slots = torch.tensor([_slot(w.blocks, p, bsz) for p in range(w.end)], dtype=torch.long)
        wrong = torch.zeros(w.end, dtype=torch.bool)
        for lay in range(layer + 1):
            k_slots, v_slots = self.cache.slots(lay)
            for cache, truth in ((k_slots, dense.k[lay]), (v_slots, dense.v[lay])):
                have = cache[slots.to(cache.device)].float().cpu()
                want = truth.to(self.cache.dtype).float()
                ok = (have - want).abs() <= self.atol + self.rtol * want.abs()
                wrong |= ~ok.flatten(1).all(1)
        blocks = []
        for index, block in enumerate(w.blocks):
            positions = [
                p for p in range(index * bsz, min(w.end, (index + 1) * bsz)) if bool(wrong[p])
            ]
            if not positions:
                continue
            held = [int(self.written[block, p % bsz]) for p in positions]
            zombie = any(h != dense.hashes[p] for h, p in zip(held, positions, strict=True))
            never = all(h == 0 for h in held)
            blocks.append(BadBlock(block, index, (positions[0], positions[-1]), zombie, never))
        return tuple(blocks)


def _slot(blocks: tuple[int, ...], position: int, block_size: int) -> int:
    return blocks[position // block_size] * block_size + position % block_size


def _backend(name: str, device: str) -> tuple[Callable[..., None], Callable[..., torch.Tensor]]:
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
