"""A mixed batch for paged attention: which queries, which context, which blocks.

Sequence ``i`` of a batch has ``query_lens[i]`` new query tokens (1 for a decode, more for a
prefill chunk) and a context of ``seq_lens[i]`` tokens, the new ones included: its queries are
the positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``, and query ``j`` attends keys
``0 .. seq_lens[i] - query_lens[i] + j`` (causal, aligned to the bottom right). Queries of all
sequences are concatenated (varlen): sequence ``i``'s start at ``query_start_loc[i]``. Its keys
live in the blocks ``block_tables[i]``, block ``b`` holding positions ``b*B .. (b+1)*B - 1``.

Build one with ``make_batch`` once per step (it copies the metadata to the device); kernels and
the torch oracle then read it. Pure torch: the oracle and the CPU fallback need no Triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    query_start_loc: torch.Tensor
    """``[num_seqs + 1]`` int32: cumulative query lengths."""
    seq_lens_t: torch.Tensor
    """``[num_seqs]`` int32."""
    block_tables_t: torch.Tensor
    """``[num_seqs, max_blocks]`` int32, padded with the null block 0."""
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One entry per program of a kernel that takes ``block_q`` queries of one sequence at a
        time: the sequence (int32) and the index of the tile's first query in it (int32)."""
        if block_q not in self._tiles:
            seqs: list[int] = []
            starts: list[int] = []
            for i, q in enumerate(self.query_lens):
                for start in range(0, q, block_q):
                    seqs.append(i)
                    starts.append(start)
            dev = self.device
            self._tiles[block_q] = (
                torch.tensor(seqs, dtype=torch.int32, device=dev),
                torch.tensor(starts, dtype=torch.int32, device=dev),
            )
        return self._tiles[block_q]


def make_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: str | torch.device = "cpu",
) -> Batch:
    """Validate and copy a batch's metadata to ``device``; raise ValueError when a sequence has
    more queries than context or its table does not cover its context."""
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables differ in length")
    for i, (q, n, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 0 <= q <= n:
            raise ValueError(f"sequence {i}: {q} queries with a context of {n}")
        if len(table) * block_size < n:
            raise ValueError(f"sequence {i}: {len(table)} blocks cannot hold {n} tokens")
    width = max((len(t) for t in block_tables), default=0) or 1
    tables = torch.zeros((len(block_tables), width), dtype=torch.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(list(table), dtype=torch.int32)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return Batch(
        tuple(int(q) for q in query_lens),
        tuple(int(n) for n in seq_lens),
        tuple(tuple(int(b) for b in t) for t in block_tables),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        tables.to(device),
    )
