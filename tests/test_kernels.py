"""The Triton kernels against the torch oracle: GQA, MQA, odd groups, block sizes, mixed batches,
sliding window, softcap, dtypes, split key ranges; the write's negative slots; every output
element stored exactly once. Without a GPU they run under Triton's interpreter on small shapes."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from kvspec.impl.paged import kernels  # noqa: E402
from kvspec.impl.paged.attention_ref import (  # noqa: E402
    dense_attention,
    gather,
    paged_attention_ref,
    write_kv_ref,
)
from kvspec.impl.paged.batch import Batch, make_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_PTXAS = (Path(kernels.triton.__file__).parent / "backends/nvidia/bin/ptxas").exists()


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: (1e-5, 0.0), torch.float16: (1.5e-2, 1e-2), torch.bfloat16: (1.5e-2, 1e-2)}


def make_case(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Batch]:
    """A NaN cache (garbage) with each sequence's context written through a shuffled block
    table; random queries."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    for table, n in zip(tables, seq_lens, strict=True):
        pos = torch.arange(n)
        slots = (torch.tensor(table)[pos // block_size] * block_size + pos % block_size).to(DEVICE)
        k = torch.randn((n, kv_heads, head_dim), generator=gen).to(DEVICE, dtype)
        v = torch.randn((n, kv_heads, head_dim), generator=gen).to(DEVICE, dtype)
        write_kv_ref(k, v, k_cache, v_cache, slots)
    q = torch.randn((sum(query_lens), heads, head_dim), generator=gen).to(DEVICE, dtype)
    return q, k_cache, v_cache, make_batch(query_lens, seq_lens, tables, block_size, DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any(), "NaN in the output: a read outside the context"
    err = (got - want).abs()
    assert (err <= atol + rtol * want.abs()).all(), f"max error {err.max().item():.3g}"


MIXED = ([1, 5, 16, 1], [37, 21, 16, 3])  # decode, chunk over cached context, prefill, decode

CASES = {
    "gqa-4/2-block16": dict(heads=4, kv_heads=2, block_size=16),
    "gqa-4/2-block32": dict(heads=4, kv_heads=2, block_size=32),
    "mqa-4/1-block32": dict(heads=4, kv_heads=1, block_size=32),
    "mha-2/2-block16": dict(heads=2, kv_heads=2, block_size=16),
    "group-9/3": dict(heads=9, kv_heads=3, block_size=16),
    "group-5/1-dim24": dict(heads=5, kv_heads=1, block_size=16, head_dim=24),
    "block4-spans-tiles": dict(heads=4, kv_heads=2, block_size=4),
    "block3": dict(heads=4, kv_heads=2, block_size=3),
    "window-8": dict(heads=4, kv_heads=2, block_size=16, window=8),
    "softcap-2": dict(heads=4, kv_heads=2, block_size=16, softcap=2.0),
    "window-softcap-block4": dict(heads=4, kv_heads=2, block_size=4, window=5, softcap=3.0),
    "fp16": dict(heads=4, kv_heads=2, block_size=16, dtype=torch.float16),
    "bf16": dict(heads=4, kv_heads=2, block_size=16, dtype=torch.bfloat16),
    "bf16-group-9/3-block32": dict(heads=9, kv_heads=3, block_size=32, dtype=torch.bfloat16),
    "fp16-16bit-products": dict(heads=4, kv_heads=2, block_size=16, dtype=torch.float16, dot=False),
    "splits-3": dict(heads=4, kv_heads=2, block_size=16, splits=3),
    "splits-2-window-bf16": dict(
        heads=9, kv_heads=3, block_size=16, splits=2, window=12, dtype=torch.bfloat16
    ),
    "scale-0.5": dict(heads=4, kv_heads=2, block_size=16, scale=0.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_the_oracle(name: str) -> None:
    c = dict(CASES[name])
    dtype = c.pop("dtype", torch.float32)
    options = {key: c.pop(key) for key in ("window", "softcap", "scale") if key in c}
    splits, dot = c.pop("splits", None), c.pop("dot", None)
    q, k_cache, v_cache, batch = make_case(
        c["heads"], c["kv_heads"], c.get("head_dim", 16), c["block_size"], *MIXED, dtype=dtype
    )
    got = kernels.paged_attention(
        q, k_cache, v_cache, batch, num_splits=splits, dot_fp32=dot, **options
    )
    want = paged_attention_ref(q, k_cache, v_cache, batch, **options)
    assert got.dtype == dtype and got.shape == q.shape
    exact = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), batch, **options)
    assert_close(got, exact, dtype)  # against float32 math on the stored values
    assert_close(want, exact, dtype)


def test_window_never_reads_blocks_outside_it() -> None:
    """Blocks wholly before every query's window may be dropped by an engine: poison them."""
    q, k_cache, v_cache, batch = make_case(4, 2, 16, 4, [2, 1], [30, 19])
    window = 6
    for table, n, num_q in zip(batch.block_tables, batch.seq_lens, batch.query_lens, strict=True):
        first_key = n - num_q - window + 1
        for index, block in enumerate(table):
            if (index + 1) * 4 <= first_key:
                k_cache[block] = float("nan")
                v_cache[block] = float("nan")
    got = kernels.paged_attention(q, k_cache, v_cache, batch, window=window)
    assert_close(got, paged_attention_ref(q, k_cache, v_cache, batch, window=window), q.dtype)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2)])
def test_every_output_element_is_written_exactly_once(
    splits: int, heads: int, kv_heads: int
) -> None:
    """The interpreter runs programs one after another, so a race (two programs storing the
    same element) or a gap would pass unnoticed: count the stores."""
    q, k_cache, v_cache, batch = make_case(heads, kv_heads, 16, 16, [1, 7, 13, 2], [40, 7, 29, 2])
    out = torch.full_like(q, float("nan"))
    count = torch.zeros(q.shape, dtype=torch.int32, device=DEVICE)
    split_count = torch.zeros((splits, *q.shape), dtype=torch.int32, device=DEVICE)
    kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        batch,
        out=out,
        num_splits=splits,
        block_m=16,
        write_count=count,
        split_count=split_count,
    )
    assert (count == 1).all(), f"stores per element: {count.unique().tolist()}"
    if splits > 1:
        assert (split_count == 1).all()
    assert not out.isnan().any()
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, batch), q.dtype)


def test_write_skips_negative_slots_and_touches_nothing_else() -> None:
    num_blocks, block_size, kv_heads, head_dim = 5, 16, 3, 12  # 36 values a slot: padded lanes
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE)
    tokens = 37  # not a multiple of the 16 tokens a program writes
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[::4] = -1
    slots[5] = -7
    key = torch.randn((tokens, kv_heads, head_dim), device=DEVICE)
    value = torch.randn((tokens, kv_heads, head_dim), device=DEVICE)
    kernels.write_kv(key, value, k_cache, v_cache, slots.to(DEVICE))
    want_k = torch.full(shape, float("nan"), device=DEVICE)
    want_v = torch.full(shape, float("nan"), device=DEVICE)
    write_kv_ref(key, value, want_k, want_v, slots.to(DEVICE))
    assert torch.equal(k_cache.isnan(), want_k.isnan()) and torch.equal(
        v_cache.isnan(), want_v.isnan()
    )
    assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), want_v.nan_to_num())
    written = int((~k_cache.isnan()).all(-1).all(-1).sum())
    assert written == int((slots >= 0).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_then_attend_round_trip(dtype: torch.dtype) -> None:
    """The write kernel fills a context that the attention kernel then reads back."""
    q, k_cache, v_cache, batch = make_case(4, 2, 16, 16, [3], [20], dtype=dtype)
    table = batch.block_tables[0]
    fresh_k = torch.full_like(k_cache, float("nan"))
    fresh_v = torch.full_like(v_cache, float("nan"))
    pos = torch.arange(20)
    slots = (torch.tensor(table)[pos // 16] * 16 + pos % 16).to(DEVICE)
    kernels.write_kv(
        gather(k_cache, table, 20), gather(v_cache, table, 20), fresh_k, fresh_v, slots
    )
    assert torch.equal(gather(fresh_k, table, 20), gather(k_cache, table, 20))
    got = kernels.paged_attention(q, fresh_k, fresh_v, batch)
    assert_close(got, paged_attention_ref(q, k_cache, v_cache, batch), dtype)


def test_oracle_aligns_the_causal_mask_bottom_right() -> None:
    """Query i of Q over L keys sees keys 0 .. L - Q + i: checked one query at a time, and
    torch's ``is_causal=True`` (top-left when Q < L) is shown to differ."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((3, 2, 8), generator=gen)
    k = torch.randn((7, 2, 8), generator=gen)
    v = torch.randn((7, 2, 8), generator=gen)
    got = dense_attention(q, k, v)
    for i in range(3):
        visible = 7 - 3 + i + 1
        s = torch.einsum("hd,khd->hk", q[i], k[:visible]) / math.sqrt(8)
        want = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v[:visible])
        assert torch.allclose(got[i], want, atol=1e-6)
    top_left = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    assert not torch.allclose(top_left, got, atol=1e-3)


def test_bad_shapes_are_refused() -> None:
    q, k_cache, v_cache, batch = make_case(4, 2, 16, 16, [2], [5])
    with pytest.raises(ValueError, match="query heads"):
        kernels.paged_attention(q[:, :3], k_cache, v_cache, batch)
    with pytest.raises(ValueError, match="cast first"):
        kernels.write_kv(q[:, :2].half(), q[:, :2].half(), k_cache, v_cache, torch.zeros(2))
    with pytest.raises(ValueError, match="cannot hold"):
        make_batch([1], [40], [[1, 2]], 16)


@pytest.mark.skipif(not HAS_PTXAS, reason="this triton has no NVIDIA backend")
def test_kernels_compile_for_sm90_without_spills() -> None:
    """The interpreter checks no GPU typing rules (tl.dot shapes, loop-carried types) and no
    register pressure: compile the serving configurations for sm_90 with the bundled ptxas, in
    a process where Triton is not in interpreter mode."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent.parent / "bench" / "compile_sm90.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" 0 spilled") >= 7, done.stdout


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_serving_shapes_on_gpu(dtype: torch.dtype) -> None:
    """32 query / 8 KV heads of 128, contexts to 4k: decodes and chunks in one batch."""
    query_lens = [1] * 6 + [300, 64]
    seq_lens = [4096, 1, 17, 2500, 999, 3000, 4000, 64]
    q, k_cache, v_cache, batch = make_case(32, 8, 128, 16, query_lens, seq_lens, dtype)
    got = kernels.paged_attention(q, k_cache, v_cache, batch)
    exact = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), batch)
    assert_close(got, exact, dtype)
    got = kernels.paged_attention(q, k_cache, v_cache, batch, window=512, softcap=30.0)
    exact = paged_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), batch, window=512, softcap=30.0
    )
    assert_close(got, exact, dtype)
