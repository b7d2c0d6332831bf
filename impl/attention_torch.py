"""Paged attention in plain torch, batched: the LLM engine's attention backend on a CPU.

Same contract as ``kernels.paged_attention`` and ``attention_ref.paged_attention_ref`` (queries
``[T, Hq, D]`` of a mixed ``batch.Batch`` over a layer's ``[num_blocks, block_size, Hkv, D]``
caches, read through the block tables, causal aligned to the bottom right, GQA), without
softcap or sliding window (Llama uses neither). ``paged_attention_ref`` walks the sequences one
by one with many small ops; here all decodes (one query each) of a step are one gather through
the padded block tables and two einsums, and each prefill chunk is one such call on its own (so
no decode is padded to a chunk's length). Keys past a sequence's length (padding, the rest of
its last block) get no weight and their V is zeroed, so garbage there cannot leak (NaN times a
zero weight is NaN). Scores and softmax are float32. ``tests/test_llm.py`` checks it against the oracle.
"""

from __future__ import annotations

import math

import torch

from .batch import Batch


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: Batch,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
    if decodes:
        _attend(q, k_cache, v_cache, batch, decodes, scale, out)
    for i, n in enumerate(batch.query_lens):
        if n > 1:
            _attend(q, k_cache, v_cache, batch, [i], scale, out)
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: Batch,
    seqs: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    dev = q.device
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qlens = [batch.query_lens[i] for i in seqs]
    lens = [batch.seq_lens[i] for i in seqs]
    starts = [int(batch.query_start_loc[i]) for i in seqs] if len(seqs) > 1 else None
    n, max_q, max_len = len(seqs), max(qlens), max(lens)
    num_blocks = -(-max_len // block_size)
    index = torch.tensor(seqs, dtype=torch.long, device=dev)
    tables = batch.block_tables_t[index, :num_blocks].reshape(-1).long()
    shape = (n, num_blocks * block_size, num_kv_heads, head_dim)
    k = k_cache.index_select(0, tables).view(shape).float()  # copies: ours to change
    v = v_cache.index_select(0, tables).view(shape).float()
    lens_t = torch.tensor(lens, device=dev)
    key_pos = torch.arange(num_blocks * block_size, device=dev)
    invalid = key_pos[None, :] >= lens_t[:, None]  # [n, L]: past the sequence's end
    v.masked_fill_(invalid[:, :, None, None], 0.0)  # garbage K is masked in the scores below
    if starts is None:  # one sequence: its rows are contiguous
        first = int(batch.query_start_loc[seqs[0]])
        rows = torch.arange(first, first + max_q, device=dev)[None, :]
    else:  # decodes: one row each
        rows = torch.tensor(starts, device=dev)[:, None]
    qq = q[rows].float().view(n, max_q, num_kv_heads, group, head_dim)
    q_pos = (lens_t - torch.tensor(qlens, device=dev))[:, None] + torch.arange(max_q, device=dev)
    allowed = (key_pos[None, None, :] <= q_pos[:, :, None]) & ~invalid[:, None, :]  # [n, Q, L]
    scores = torch.einsum("sqkgd,slkd->skgql", qq, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.einsum("skgql,slkd->sqkgd", probs, v).reshape(n, max_q, num_heads, head_dim)
    out[rows.reshape(-1)] = result.reshape(n * max_q, num_heads, head_dim).to(out.dtype)
