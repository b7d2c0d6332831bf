"""GPU check of the paged attention kernels (issue #5): correctness, decode bandwidth, speed.

Serving shapes: 32 query heads over 8 KV heads, head dim 128, bfloat16, blocks of 16 tokens,
contexts up to 8k, block tables shuffled (no two neighbouring positions in neighbouring blocks).

1. Correctness against dense attention (gather through the block table, then float32 attention
   with an explicit bottom-right causal mask): decode batches, chunked prefill over a cached
   context, a whole prefill, and the sliding-window and softcap options; vLLM's bf16 tolerance
   (atol 1.5e-2, rtol 1e-2).
2. Copy bandwidth of the device (a large tensor copy, bytes read + written per second), then the
   decode kernel's bandwidth (K and V bytes of every context read once, per second) as a fraction
   of it. Target: 70% or more.
3. Time against torch's dense ``scaled_dot_product_attention`` (contiguous K/V) and compiled flex
   attention, for decode and for prefill. Target: prefill within 1.5x of dense SDPA.

Prints its figures; stops adding measurements once ``--budget`` seconds (default 300) are spent.

    python bench/gpu_attention.py [--budget 300] [--no-flex]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from checkout import import_kvspec  # noqa: E402

import_kvspec()

from kvspec.impl.paged.attention_ref import paged_attention_ref  # noqa: E402
from kvspec.impl.paged.batch import Batch, make_batch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
ATOL, RTOL = 1.5e-2, 1e-2


def random_batch(query_lens: list[int], seq_lens: list[int], seed: int = 0):
    """A batch over a cache with just enough blocks, tables shuffled; random K/V and queries."""
    rng = random.Random(seed)
    need = [-(-n // BLOCK) for n in seq_lens]
    ids = list(range(1, sum(need) + 1))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (sum(need) + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)
    q = torch.randn((sum(query_lens), HEADS, HEAD_DIM), generator=gen, device="cuda").to(DTYPE)
    batch = make_batch(query_lens, seq_lens, tables, BLOCK, "cuda")
    return q, k_cache, v_cache, batch


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60))


def check_correctness(kernels) -> bool:
    cases = [
        ("decode, 16 seqs, contexts 1..8k", [1] * 16, None, {}),
        ("chunked prefill 512 over 4k and 8k + 6 decodes", [512, 512] + [1] * 6, None, {}),
        ("whole prefill of 2k", [2048], [2048], {}),
        ("decode + chunk, sliding window 1024", [1] * 4 + [256], None, {"window": 1024}),
        ("decode + chunk, softcap 30", [1] * 4 + [256], None, {"softcap": 30.0}),
    ]
    ok = True
    print("correctness against dense attention (bf16, vLLM tolerance atol 1.5e-2, rtol 1e-2)")
    for name, query_lens, seq_lens, options in cases:
        rng = random.Random(len(query_lens))
        if seq_lens is None:
            seq_lens = [q + rng.randrange(1, 8192 - q) for q in query_lens]
        q, k_cache, v_cache, batch = random_batch(query_lens, seq_lens)
        got = kernels.paged_attention(q, k_cache, v_cache, batch, **options).float()
        want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), batch, **options)
        err = (got - want.float()).abs()
        good = bool((err <= ATOL + RTOL * want.float().abs()).all())
        ok &= good
        print(f"  {name:50s} max error {err.max().item():.2e}  {'ok' if good else 'FAIL'}")
    return ok


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def sdpa(q, k, v, causal: bool):
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        return f(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:  # torch without enable_gqa
        group = q.shape[1] // k.shape[1]
        return f(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal)


def dense_layout(q: torch.Tensor, k_cache, v_cache, batch: Batch):
    """Equal-length sequences as dense ``[B, H, L, D]`` tensors for SDPA and flex attention."""
    n = batch.seq_lens[0]
    slots = []
    for table in batch.block_tables:
        pos = torch.arange(n, device="cuda")
        blocks = torch.tensor(table, device="cuda")
        slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
    idx = torch.stack(slots)
    k = k_cache.view(-1, KV_HEADS, HEAD_DIM)[idx].transpose(1, 2).contiguous()
    v = v_cache.view(-1, KV_HEADS, HEAD_DIM)[idx].transpose(1, 2).contiguous()
    qd = q.view(batch.num_seqs, -1, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return qd, k, v


def make_flex(causal: bool, q_len: int, kv_len: int):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = None
    if causal:
        offset = kv_len - q_len

        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        mask = create_block_mask(causal_mask, None, None, q_len, kv_len, device="cuda")

    def run(q, k, v):
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=300.0, help="seconds (default 300)")
    parser.add_argument("--no-flex", action="store_true", help="skip flex attention")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (the script is ready for a GPU machine)")
        return 2
    started = time.monotonic()
    from kvspec.impl.paged import kernels

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    import triton

    print(f"triton {triton.__version__}; shapes: {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, bf16")
    correct = check_correctness(kernels)

    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s (2 GiB device copy, read + write)")

    flex_ok = {"decode": not args.no_flex, "prefill": not args.no_flex}
    results: dict[str, float] = {}
    print("decode (1 query per sequence): time, bandwidth, fraction of copy bandwidth")
    for seqs, ctx in ((8, 8192), (32, 8192), (64, 4096), (128, 8192)):
        if time.monotonic() - started > args.budget * 0.6:
            print("  (budget spent: remaining decode shapes skipped)")
            break
        q, k_cache, v_cache, batch = random_batch([1] * seqs, [ctx] * seqs)
        ms = bench_ms(lambda: kernels.paged_attention(q, k_cache, v_cache, batch))  # noqa: B023
        nbytes = 2 * seqs * ctx * KV_HEADS * HEAD_DIM * k_cache.element_size()
        bw = nbytes / (ms * 1e-3)
        qd, kd, vd = dense_layout(q, k_cache, v_cache, batch)
        sdpa_ms = bench_ms(lambda: sdpa(qd, kd, vd, False))  # noqa: B023
        line = (
            f"  {seqs:4d} x {ctx:5d}: {ms * 1e3:8.1f} us  {bw / 1e12:5.2f} TB/s  "
            f"{bw / copy_bw:6.1%} of copy   sdpa(dense) {sdpa_ms * 1e3:8.1f} us"
        )
        if flex_ok["decode"] and time.monotonic() - started < args.budget * 0.5:
            try:
                flex = make_flex(False, 1, ctx)
                if flex is not None:
                    flex(qd, kd, vd)
                    line += f"   flex {bench_ms(lambda: flex(qd, kd, vd)) * 1e3:8.1f} us"  # noqa: B023
            except Exception as err:  # flex is a comparison, not the subject
                line += f"   flex failed: {type(err).__name__}"
                flex_ok["decode"] = False
        print(line)
        results[f"decode {seqs}x{ctx}"] = bw / copy_bw

    print("prefill (causal, queries = context): time against dense SDPA and flex attention")
    for seqs, n in ((1, 4096), (1, 8192), (4, 2048)):
        if time.monotonic() - started > args.budget * 0.85:
            print("  (budget spent: remaining prefill shapes skipped)")
            break
        q, k_cache, v_cache, batch = random_batch([n] * seqs, [n] * seqs)
        ms = bench_ms(lambda: kernels.paged_attention(q, k_cache, v_cache, batch))  # noqa: B023
        qd, kd, vd = dense_layout(q, k_cache, v_cache, batch)
        sdpa_ms = bench_ms(lambda: sdpa(qd, kd, vd, True))  # noqa: B023
        flops = 4 * seqs * HEADS * HEAD_DIM * n * n / 2
        line = (
            f"  {seqs} x {n:5d}: {ms:7.3f} ms ({flops / ms / 1e9:6.1f} TFLOP/s)  "
            f"sdpa {sdpa_ms:7.3f} ms  ratio {ms / sdpa_ms:4.2f}x"
        )
        if flex_ok["prefill"] and time.monotonic() - started < args.budget * 0.75:
            try:
                flex = make_flex(True, n, n)
                if flex is not None:
                    flex(qd, kd, vd)
                    line += f"   flex {bench_ms(lambda: flex(qd, kd, vd)):7.3f} ms"  # noqa: B023
            except Exception as err:
                line += f"   flex failed: {type(err).__name__}"
                flex_ok["prefill"] = False
        print(line)
        results[f"prefill {seqs}x{n}"] = ms / sdpa_ms

    decode = [v for k, v in results.items() if k.startswith("decode")]
    prefill = [v for k, v in results.items() if k.startswith("prefill")]
    print("summary:")
    print(f"  correctness: {'ok' if correct else 'FAIL'}")
    if decode:
        print(f"  decode bandwidth: best {max(decode):.1%} of copy (target >= 70%)")
    if prefill:
        print(f"  prefill: worst {max(prefill):.2f}x dense SDPA (target <= 1.5x)")
    print(f"  {time.monotonic() - started:.0f} s")
    return 0 if correct else 1


if __name__ == "__main__":
    raise SystemExit(main())
