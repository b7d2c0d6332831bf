"""The paged KV cache: per layer, one K and one V tensor of fixed-size blocks.

Layout of ``k[layer]`` and ``v[layer]``: shape ``[num_blocks, block_size, num_kv_heads, head_dim]``,
row-major and contiguous, so the strides in elements are::

    (block_size * num_kv_heads * head_dim,  num_kv_heads * head_dim,  head_dim,  1)

Token slot ``slot = block * block_size + offset`` holds its K (and V) at ``k[block, offset]``: one
block is one contiguous chunk, the heads of a slot are adjacent and a head's ``head_dim`` values
are contiguous (what a kernel loads with one vector access). ``k.view(-1, num_kv_heads,
head_dim)[slot]`` is that slot. Block 0 is the engine's null block: allocated here like any other,
never written by a correct engine.

Storage is float32, float16 or bfloat16; kernels load it, compute in float32 and store results
back in the storage type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class KVCache:
    k: list[torch.Tensor]
    """Per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        """A cache whose every slot holds NaN: garbage that poisons any read of it."""
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported KV cache dtype {dtype}; one of {', '.join(DTYPES)}")
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError("every dimension of a KV cache must be >= 1")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def make() -> torch.Tensor:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)

        return cls([make() for _ in range(num_layers)], [make() for _ in range(num_layers)])

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def fill(self, block: int, value: float = float("nan")) -> None:
        """Overwrite one block in every layer (NaN: fresh garbage)."""
        for t in (*self.k, *self.v):
            t[block].fill_(value)

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_blocks * block_size, num_kv_heads, head_dim]`` views."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)
