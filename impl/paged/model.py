"""A deterministic attention-only toy model: every value is a function of a token prefix.

Position ``p`` of a sequence is identified by the chained hash ``h_p`` of its tokens
``0 .. p`` (splitmix64, stable across runs and machines). From it, per layer ``l``:

* the query ``q^l_p`` and, in layer 0, the key ``k^0_p`` and value ``v^0_p`` are pseudo-random
  (uniform, unit variance), seeded by ``h_p``;
* above layer 0, ``k^l_p`` and ``v^l_p`` mix a seeded part with the layer below's attention output
  at ``p`` (averaged over each KV head's query group): as in a transformer, K/V computed from a
  wrong read are wrong too, so garbage spreads the way the spec says it does.

``ToyModel.forward(tokens)`` is the dense forward pass from scratch (float32, attention written
out in ``attention_ref.dense_attention``), cached by prefix and extended incrementally (causal:
a longer prefix leaves earlier positions unchanged). ``ToyModel.kv_above`` is the one function
that both the dense pass and the paged replay use to turn an attention output into the next
layer's K/V.

Hybrid models (``layers``: one ``Layer`` per layer): a ``window`` layer attends over the last
``window`` keys only; a ``state`` layer is a recurrence instead of attention, the toy form of a
Mamba / linear-attention layer: its state after ``p + 1`` tokens is the running sum
``S_p = S_{p-1} + v_p`` of the layer's values (float32, per KV head), a function of the prefix
alone, and its output at ``p`` is ``state_output(S_p, q_p, p)``. ``state_sums`` and
``state_output`` are the functions both the dense pass and the replay use (the replay starts
from the sum it reads from a state block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .attention_ref import dense_attention

MASK64 = (1 << 64) - 1
_KINDS = {"q": 0, "k": 1, "v": 2}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def prefix_hashes(tokens: Sequence[int], seed: int = 0) -> list[int]:
    """``h_p`` for every position: ``h_p = splitmix64(h_{p-1} ^ splitmix64(token_p))``."""
    h = _splitmix64(seed & MASK64)
    out = []
    for token in tokens:
        h = _splitmix64(h ^ _splitmix64(int(token) & MASK64))
        out.append(h or 1)  # 0 means "nothing written" in the replay's bookkeeping
    return out


@dataclass(frozen=True)
class Layer:
    """What one layer computes: ``full`` or ``window`` attention (``window`` keys), or a
    ``state`` recurrence."""

    kind: str = "full"
    window: int = 0


LAYER_KINDS = ("full", "window", "state")


@dataclass
class Dense:
    """The dense forward pass over a prefix: per layer, ``[n, heads, head_dim]`` float32;
    ``s``: per layer, a state layer's sums ``S_p`` ``[n, kv_heads, head_dim]`` (None for an
    attention layer)."""

    hashes: list[int]
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    o: list[torch.Tensor]
    s: list[torch.Tensor | None] = field(default_factory=list)


class ToyModel:
    def __init__(
        self,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        seed: int = 0,
        cache_size: int = 256,
        layers: Sequence[Layer] = (),
        device: str | torch.device = "cpu",
    ) -> None:
        """``layers``: one per layer (empty: every layer full attention); ``device``: where the
        dense pass computes and its tensors live."""
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
        if min(num_layers, num_heads, num_kv_heads, head_dim) < 1:
            raise ValueError("layers, heads and head_dim must be >= 1")
        self.num_layers, self.num_heads = num_layers, num_heads
        self.num_kv_heads, self.head_dim, self.seed = num_kv_heads, head_dim, seed
        self.layers = tuple(layers) or (Layer(),) * num_layers
        if len(self.layers) != num_layers:
            raise ValueError(f"{len(self.layers)} layer kinds for {num_layers} layers")
        for layer in self.layers:
            if layer.kind not in LAYER_KINDS or (layer.kind == "window") != (layer.window > 0):
                raise ValueError(f"bad layer {layer}: a window needs kind window, and only it")
        self.device = torch.device(device)
        self._cache: OrderedDict[int, Dense] = OrderedDict()
        self._cache_size = cache_size

    def seeded(self, hashes: Sequence[int], layer: int, kind: str) -> torch.Tensor:
        """Uniform values of unit variance, ``[n, heads, head_dim]`` (query heads for ``q``)."""
        heads = self.num_heads if kind == "q" else self.num_kv_heads
        width = heads * self.head_dim
        salt = ((self.seed * 64 + layer) * 4 + _KINDS[kind]) << 32
        lanes = _splitmix64_np(np.arange(width, dtype=np.uint64) + np.uint64(salt & MASK64))
        h = np.asarray(hashes, dtype=np.uint64).reshape(-1, 1)
        bits = _splitmix64_np(h ^ lanes[None, :]) >> np.uint64(40)  # 24 random bits
        unit = bits.astype(np.float64) / float(1 << 24)
        values = (unit * 2.0 - 1.0) * np.sqrt(3.0)
        out = torch.from_numpy(values.astype(np.float32)).view(-1, heads, self.head_dim)
        return out.to(self.device)

    def kv_above(
        self, layer: int, hashes: Sequence[int], below: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer >= 1`` from the layer below's attention output ``[n, Hq, D]``."""
        group = self.num_heads // self.num_kv_heads
        mixed = below.float().reshape(-1, self.num_kv_heads, group, self.head_dim).mean(2)
        k = 0.6 * self.seeded(hashes, layer, "k").to(mixed.device) + 0.8 * mixed
        v = 0.6 * self.seeded(hashes, layer, "v").to(mixed.device) - 0.8 * mixed
        return k, v

    def state_output(self, sums: torch.Tensor, q: torch.Tensor, first: int) -> torch.Tensor:
        """A state layer's output ``[n, Hq, D]`` at positions ``first .. first + n - 1`` from its
        sums there ``[n, Hkv, D]`` and its queries: the mean-like ``S_p / sqrt(p + 1)`` of each
        KV head, gated per query head by ``1 + q / 4``."""
        group = self.num_heads // self.num_kv_heads
        pos = torch.arange(first, first + sums.shape[0], device=sums.device, dtype=torch.float32)
        scaled = sums / torch.sqrt(pos + 1.0)[:, None, None]
        return scaled.repeat_interleave(group, 1) * (1.0 + 0.25 * q.float())

    @staticmethod
    def state_sums(before: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
        """``S_p`` for the positions of ``v`` ``[n, Hkv, D]``, from the sum before them (None:
        the empty prefix)."""
        sums = torch.cumsum(v.float(), 0)
        return sums if before is None else sums + before.float()

    def forward(self, tokens: Sequence[int]) -> Dense:
        """The dense pass over ``tokens`` (all of them), from the longest cached prefix on."""
        hashes = prefix_hashes(tokens, self.seed)
        n = len(hashes)
        if n == 0:
            raise ValueError("forward of an empty prefix")
        base: Dense | None = None
        for m in range(n, 0, -1):
            base = self._cache.get(hashes[m - 1])
            if base is not None:
                self._cache.move_to_end(hashes[m - 1])
                break
        done = 0 if base is None else len(base.hashes)
        if done == n and base is not None:
            return base
        new = hashes[done:]
        result = Dense(hashes, [], [], [], [])
        below: torch.Tensor | None = None
        for layer in range(self.num_layers):
            q = self.seeded(new, layer, "q")
            if layer == 0:
                k, v = self.seeded(new, 0, "k"), self.seeded(new, 0, "v")
            else:
                assert below is not None
                k, v = self.kv_above(layer, new, below)
            kind = self.layers[layer]
            sums: torch.Tensor | None = None
            if kind.kind == "state":
                before = None if base is None else base.s[layer][-1]  # type: ignore[index]
                sums = self.state_sums(before, v)
                out = self.state_output(sums, q, done)
            if base is not None:
                q = torch.cat([base.q[layer], q])
                k = torch.cat([base.k[layer], k])
                v = torch.cat([base.v[layer], v])
                if sums is not None:
                    sums = torch.cat([base.s[layer], sums])  # type: ignore[list-item]
            if kind.kind != "state":
                out = dense_attention(q[done:], k, v, window=kind.window)
            below = out
            result.q.append(q)
            result.k.append(k)
            result.v.append(v)
            result.s.append(sums)
            result.o.append(out if base is None else torch.cat([base.o[layer], out]))
        self._cache[hashes[-1]] = result
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return result
