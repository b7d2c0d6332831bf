"""Triton kernels for a paged KV cache: the write, and paged attention for mixed batches.

``write_kv`` scatters each token's K and V to its slot (``slot = block * block_size + offset``;
negative slots are skipped), like vLLM's ``reshape_and_cache``. ``paged_attention`` computes, for
a mixed batch (``batch.Batch``: decodes, prefill chunks over a cached context, whole prefills),
each query's attention over its sequence's context read through the block table: causal aligned
to the bottom right, GQA/MQA with any group size (9/3, 5/1), optional sliding window and softcap,
any block size (a key's block and offset are computed per key, so tiles may span blocks).

Attention kernel, one program per (tile of ``BLOCK_Q`` queries of one sequence, KV head, split):
the ``group`` query heads that share the KV head are stacked with the tile's queries into
``BLOCK_M = BLOCK_Q * group`` (padded) rows, so a K/V tile loaded once serves them all. It walks
the keys the tile may see in tiles of ``BLOCK_N`` (flash-attention online softmax, float32) from
the window's start to the tile's last query. With ``num_splits > 1`` (long contexts, few
programs: decode on a GPU) the key range is divided between programs that write partial results,
and a second kernel combines them.

Numerics: K, V and Q are loaded in the storage dtype; scores, softmax and accumulation are
float32 and the output is cast back. On a GPU with 16-bit storage the two matrix products take
16-bit operands (Q and K exactly, the probabilities rounded to 16 bits) with float32 accumulation,
as flash attention does; with float32 storage, and always under the interpreter
(``TRITON_INTERPRET=1``, whose bfloat16 ``tl.dot`` is wrong: triton issue 11584), the products are
float32 (``input_precision="ieee"``, never TF32). Only long-standing Triton APIs are used (no block
pointers, no autotuning): Triton 3.6 to 3.9.

Races are invisible to the interpreter, which runs programs one after another: pass
``write_count`` (int32, shaped like the output) to count every output element's stores.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .batch import Batch

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """Kernels run under Triton's CPU interpreter (set before ``triton`` was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------------------------
# the write


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    """``BLOCK_T`` tokens per program; the ``NUM_KV_HEADS * HEAD_DIM`` values of a token are
    flattened into one row of ``BLOCK_HD`` (padded) lanes."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slot >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    lane = tl.arange(0, BLOCK_HD)
    head = lane // HEAD_DIM
    dim = lane % HEAD_DIM
    mask = valid[:, None] & (lane < NUM_KV_HEADS * HEAD_DIM)[None, :]
    row = tok.to(tl.int64)[:, None]
    dst = (
        block[:, None] * stride_cb
        + offset[:, None] * stride_cs
        + head[None, :] * stride_ch
        + dim[None, :] * stride_cd
    )
    src_k = key_ptr + row * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    src_v = value_ptr + row * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_t: int | None = None,
) -> None:
    """Write ``key[t]`` and ``value[t]`` (``[T, Hkv, D]``, the cache's dtype) to slot
    ``slot_mapping[t]`` of a layer's ``[num_blocks, block_size, Hkv, D]`` caches; negative slots
    are skipped. Slots must be distinct."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape:
        raise ValueError(f"shapes differ: key {key.shape}, value {value.shape}")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache {tuple(k_cache.shape)} cannot hold K/V of {tuple(key.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"K/V are {key.dtype}, the cache is {k_cache.dtype}: cast first")
    if k_cache.stride() != v_cache.stride() or slot_mapping.shape != (num_tokens,):
        raise ValueError("K and V caches must share strides; one slot per token")
    if num_tokens == 0:
        return
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = block_t or write_tokens_per_program(block_hd)
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.to(torch.int64),
        num_tokens,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
    )


def write_tokens_per_program(block_hd: int) -> int:
    """Tokens one write program moves: about 2,048 values (16 tokens at most)."""
    return max(1, min(16, 2048 // block_hd))


# --------------------------------------------------------------------------------------------
# paged attention


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    count_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    scale_log2,
    softcap,
    window,
    num_tokens,
    num_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    COUNT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    ctx = tl.load(seq_lens_ptr + seq)

    # rows: BLOCK_Q queries x GROUP heads, query-major
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx - q_len + q_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # keys the tile may see: from the first query's window start to the last query's position
    last_q = tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    kv_end = ctx - q_len + last_q + 1
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(ctx - q_len + tile_start - window + 1, 0)
    lo = (kv_begin // BLOCK_N) * BLOCK_N
    hi = kv_end
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end - lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo = lo + tl.program_id(2) * per_split
        hi = tl.minimum(lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + keys
        k_ok = (k_pos >= kv_begin) & (k_pos < kv_end)
        block = tl.load(block_table_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        kv_off = block.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
        kv_off += kv_head * stride_ch
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + dims[:, None] * stride_cd,
            mask=k_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + dims[None, :] * stride_cd,
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp (no tl.tanh everywhere)
            x = s * (scale_log2 / 1.4426950408889634) / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * softcap * 1.4426950408889634
        else:
            s = s * scale_log2
        allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    count_off = (token * num_heads + head)[:, None] * HEAD_DIM + dims[None, :]
    if NUM_SPLITS > 1:  # partial results: [split, token, head, dim] and [split, token, head]
        split_row = (tl.program_id(2) * num_tokens + token) * num_heads + head
        tl.store(out_ptr + split_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
        tl.store(m_ptr + split_row, m_i, mask=row_ok)
        tl.store(l_ptr + split_row, l_i, mask=row_ok)
        count_off += tl.program_id(2) * num_tokens * num_heads * HEAD_DIM
    else:
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    if COUNT:
        tl.atomic_add(count_ptr + count_off, 1, mask=out_mask)


@triton.jit
def _combine_splits_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    count_ptr,
    num_tokens,
    num_heads,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    COUNT: tl.constexpr,
):
    """One program per (token, query head): softmax-weighted sum of the splits' partials."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < NUM_SPLITS
    dim_ok = dims < HEAD_DIM
    row = (splits * num_tokens + token) * num_heads + head
    m = tl.load(m_ptr + row, mask=split_ok, other=float("-inf"))
    l_part = tl.load(l_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(
        acc_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_use)
    total = tl.sum(w * l_part, 0)
    result = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    o_off = token * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty), mask=dim_ok)
    if COUNT:
        tl.atomic_add(count_ptr + (token * num_heads + head) * HEAD_DIM + dims, 1, mask=dim_ok)


def choose_tiles(
    group: int, max_query_len: int, head_dim: int, dtype: torch.dtype, on_gpu: bool
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a batch: 16 rows for decode batches, more
    for prefill; smaller tiles for float32 products on a GPU (no 16-bit tensor cores). On sm_90
    with head dim 128 the bf16 choices compile without register spills (ptxas: 102 registers for
    decode, 176 for prefill; ``tests/test_kernels.py`` compiles them without a GPU)."""
    rows = max_query_len * group
    block_m = max(16, triton.next_power_of_2(group))
    if rows > block_m:
        block_m = max(block_m, min(128 if on_gpu else 64, triton.next_power_of_2(rows)))
    if not on_gpu:
        return block_m, 32, 4, 1
    if dtype == torch.float32:  # float32 products run on CUDA cores: small tiles, no spills
        return max(16, triton.next_power_of_2(group)), 32, 8, 2
    if block_m >= 128:
        return block_m, 64 if head_dim <= 128 else 32, 8, 3
    return block_m, 64, 4, 2


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: Batch,
    *,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    dot_fp32: bool | None = None,
    write_count: torch.Tensor | None = None,
    split_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[T, Hq, D]`` (the batch's queries, concatenated) over a layer's paged
    ``[num_blocks, block_size, Hkv, D]`` caches; returns ``[T, Hq, D]`` in ``q``'s dtype (or
    fills ``out``). ``scale`` defaults to ``1/sqrt(D)``; ``window > 0`` keeps the last
    ``window`` keys of each query (itself included); ``softcap > 0`` caps scores.

    Tuning knobs (defaults chosen per batch): ``num_splits`` key-range splits,
    ``block_m`` rows (queries x group) and ``block_n`` keys per tile, ``dot_fp32`` float32
    matrix products. ``write_count`` / ``split_count`` (int32, zeroed, shaped like the output /
    ``[num_splits, T, Hq, D]``) count every store, for tests."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit queries {tuple(q.shape)}")
    if num_heads % num_kv_heads or k_cache.stride() != v_cache.stride():
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads")
    if num_tokens != batch.num_tokens or q.dtype != k_cache.dtype:
        raise ValueError(f"{num_tokens} queries of {q.dtype} for a batch of {batch.num_tokens}")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    on_gpu = q.is_cuda and not interpreting()
    tiles = choose_tiles(group, batch.max_query_len, head_dim, q.dtype, on_gpu)
    block_m = block_m or tiles[0]
    block_n = block_n or tiles[1]
    if block_m < group or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_m {block_m} (>= group {group}) and block_n must be powers of 2")
    block_q = block_m // group
    tile_seq, tile_start = batch.tiles(block_q)
    programs = tile_seq.numel() * num_kv_heads
    if num_splits is None:
        num_splits = _default_splits(programs, batch.max_seq_len, block_n, q.device, on_gpu)
    if dot_fp32 is None:
        dot_fp32 = not on_gpu or q.dtype == torch.float32
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    count = write_count if num_splits == 1 else split_count
    o_strides: tuple[int, ...] = (0, 0, 0)  # partials are [split, T, Hq, D], contiguous
    if num_splits > 1:
        partial = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device
        )
        m_part = torch.empty(
            (num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device
        )
        l_part = torch.empty_like(m_part)
        target = partial
    else:
        target, m_part, l_part, o_strides = out, out, out, tuple(out.stride())
    _paged_attention_kernel[(tile_seq.numel(), num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        target,
        m_part,
        l_part,
        count if count is not None else out,
        batch.block_tables_t,
        batch.seq_lens_t,
        batch.query_start_loc,
        tile_seq,
        tile_start,
        scale * LOG2E,
        float(softcap),
        int(window),
        num_tokens,
        num_heads,
        *q.stride(),
        *k_cache.stride(),
        *o_strides,
        batch.block_tables_t.stride(0),
        GROUP=group,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        USE_SOFTCAP=softcap > 0,
        USE_WINDOW=window > 0,
        DOT_FP32=bool(dot_fp32),
        COUNT=count is not None,
        num_warps=tiles[2],
        num_stages=tiles[3],
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            partial,
            m_part,
            l_part,
            out,
            write_count if write_count is not None else out,
            num_tokens,
            num_heads,
            *out.stride(),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            COUNT=write_count is not None,
            num_warps=4 if head_dim_pad >= 128 else 2,
        )
    return out


def _default_splits(
    programs: int, max_seq_len: int, block_n: int, device: torch.device, on_gpu: bool
) -> int:
    """Split the key range when the programs cannot fill the GPU's SMs twice over and contexts
    are long enough to share (at least 4 key tiles per split)."""
    if not on_gpu:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= 2 * sms:
        return 1
    return max(1, min(-(-2 * sms // max(programs, 1)), max_seq_len // (4 * block_n), 32))
