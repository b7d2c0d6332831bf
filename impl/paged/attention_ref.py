"""The torch oracle beside the kernels, and the CPU fallback backend.

``dense_attention`` is attention written out in full: float32 scores, an explicit causal mask
aligned to the bottom right (query ``i`` of ``Q`` over ``L`` keys sits at position ``L - Q + i``
and sees keys ``0 .. L - Q + i``), optional sliding window and softcap, GQA by repeating each KV
head for its group of query heads (query head ``h`` reads KV head ``h // (Hq / Hkv)``). It does
not use ``scaled_dot_product_attention(is_causal=True)``, which aligns the mask to the top left
when there are fewer queries than keys: wrong for a prefill chunk over a cached context.

``paged_attention_ref`` and ``write_kv_ref`` do what the kernels do (``kernels.py``), the slow
and obvious way: gather each sequence's context through its block table, then dense attention.
"""

from __future__ import annotations

import math

import torch

from .batch import Batch


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """``q`` ``[Q, Hq, D]``, ``k`` and ``v`` ``[L, Hkv, D]`` (L >= Q) -> float32 ``[Q, Hq, D]``.

    ``window > 0`` keeps keys ``p - window + 1 .. p`` for the query at position ``p``;
    ``softcap > 0`` maps scores ``s`` to ``softcap * tanh(s / softcap)``."""
    num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads = k.shape[0], k.shape[1]
    if num_k < num_q or num_heads % num_kv_heads:
        raise ValueError(f"{num_q} queries over {num_k} keys, {num_heads}/{num_kv_heads} heads")
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q_pos = torch.arange(num_q, device=q.device) + (num_k - num_q)
    k_pos = torch.arange(num_k, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    used = allowed.any(0)  # keys nobody may see are not read: garbage there must not leak
    kf = torch.where(used[:, None, None], k.float(), 0.0).repeat_interleave(group, 1)
    vf = torch.where(used[:, None, None], v.float(), 0.0).repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf)


def gather(cache: torch.Tensor, table: tuple[int, ...], length: int) -> torch.Tensor:
    """Positions ``0 .. length - 1`` of one sequence: ``[length, Hkv, D]`` from a layer's
    ``[num_blocks, block_size, Hkv, D]`` cache through its block table."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = torch.tensor(list(table), dtype=torch.long, device=cache.device)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: Batch,
    *,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.paged_attention``: ``q`` ``[T, Hq, D]`` -> ``[T, Hq, D]`` in
    ``q``'s dtype (or written into ``out``)."""
    out = torch.empty_like(q) if out is None else out
    starts = batch.query_start_loc.tolist()
    for i, (num_q, length) in enumerate(zip(batch.query_lens, batch.seq_lens, strict=True)):
        if num_q == 0:
            continue
        table = batch.block_tables[i]
        k, v = gather(k_cache, table, length), gather(v_cache, table, length)
        rows = slice(starts[i], starts[i] + num_q)
        result = dense_attention(q[rows], k, v, scale=scale, softcap=softcap, window=window)
        out[rows] = result.to(out.dtype)
    return out


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Token ``t``'s ``key[t]`` and ``value[t]`` (``[T, Hkv, D]``) go to slot
    ``slot_mapping[t]`` (``block * block_size + offset``); negative slots are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)
