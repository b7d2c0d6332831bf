"""Paged attention in plain torch, batched: the LLM engine's attention backend on a CPU.

Same contract as ``kernels.paged_attention`` and ``attention_ref.paged_attention_ref`` (queries
``[T, Hq, D]`` of a mixed ``batch.Batch`` over a layer's ``[num_blocks, block_size, Hkv, D]``
caches, read through the block tables, causal aligned to the bottom right, GQA), without
softcap or sliding window (Llama uses neither). ``paged_attention_ref`` walks the sequences one
by one with many small ops; here the sequences of a step are grouped by query length (powers of
two: all decodes together, chunks of 9 to 16 queries together, ...) and each group is one
gather through the padded block tables and two einsums, its queries padded to the group's
longest (at most 2x the work of the real queries, none for equal lengths), at most
``MAX_QUERIES`` padded queries per call. Keys past a sequence's length (padding, the rest of
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
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(batch.query_lens):
        if n > 0:
            groups.setdefault((n - 1).bit_length(), []).append(i)
    for bucket, seqs in groups.items():
        per_call = max(1, MAX_QUERIES >> bucket)  # bounds the scores' size per call
        for i in range(0, len(seqs), per_call):
            _attend(q, k_cache, v_cache, batch, seqs[i : i + per_call], scale, out)
    return out


MAX_QUERIES = 256
"""Padded queries per call at most (unless one sequence has more)."""


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
    starts = [int(batch.query_start_loc[i]) for i in seqs]
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
    # query j of sequence i is row starts[i] + j; padding (j >= qlens[i]) repeats the last row
    qlens_t = torch.tensor(qlens, device=dev)
    j = torch.arange(max_q, device=dev)[None, :]
    real = j < qlens_t[:, None]  # [n, Q]
    rows = torch.tensor(starts, device=dev)[:, None] + torch.minimum(j, qlens_t[:, None] - 1)
    qq = q[rows].float().view(n, max_q, num_kv_heads, group, head_dim)
    q_pos = (lens_t - qlens_t)[:, None] + torch.minimum(j, qlens_t[:, None] - 1)
    allowed = (key_pos[None, None, :] <= q_pos[:, :, None]) & ~invalid[:, None, :]  # [n, Q, L]
    scores = torch.einsum("sqkgd,slkd->skgql", qq, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.einsum("skgql,slkd->sqkgd", probs, v).reshape(n, max_q, num_heads, head_dim)
    out[rows[real]] = result[real].to(out.dtype)
