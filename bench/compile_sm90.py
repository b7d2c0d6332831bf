"""Compile the paged-attention kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's interpreter checks none of the GPU's rules (``tl.dot`` shapes, types carried through
loops) and says nothing of register pressure. This script compiles the serving configurations
(32 query / 8 KV heads of 128, blocks of 16, the tiles ``kernels.choose_tiles`` picks) down to
a cubin with the ptxas bundled in Triton's wheel, specialized as a launch on contiguous tensors
is (unit strides constant, pointers and other strides divisible by 16), and prints ptxas's
registers and spills per configuration. Exit 1 when one fails to compile or spills.

    .venv/bin/python bench/compile_sm90.py      (with TRITON_INTERPRET unset)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_sm90: unset TRITON_INTERPRET (the interpreter patches triton.language)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

try:
    from kvspec.impl.paged import kernels
except ImportError:  # not installed: this checkout's root is the package
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_attention import _import_kvspec  # type: ignore[import-not-found]

    _import_kvspec()
    from kvspec.impl.paged import kernels

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
FLOATS = ("scale_log2", "softcap")


def compile_sm90(
    kernel, pointers: dict[str, str], constexprs: dict, warps: int, stages: int
) -> str:
    """ptxas's report on the kernel compiled for sm_90."""
    names = list(kernel.arg_names)
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in FLOATS else "i32")
        for n in names
    }
    divisible = [
        i
        for i, n in enumerate(names)
        if n.endswith("_ptr") or (n.startswith("stride_") and n not in constexprs)
    ]
    source = ASTSource(
        kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in divisible},
    )
    options = dict(num_warps=warps, num_stages=stages)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    done = subprocess.run(
        [str(PTXAS), "-v", "--gpu-name", "sm_90a", "-", "-o", os.devnull],
        input=compiled.asm["ptx"],
        capture_output=True,
        text=True,
    )
    return done.stderr + done.stdout


def attention_case(dtype: torch.dtype, max_query_len: int, splits: int, extras: bool):
    group, head_dim = 4, 128
    block_m, block_n, warps, stages = kernels.choose_tiles(
        group, max_query_len, head_dim, dtype, on_gpu=True
    )
    element = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    partial = "*fp32" if splits > 1 else element
    pointers = dict(q_ptr=element, k_cache_ptr=element, v_cache_ptr=element, count_ptr="*i32")
    pointers.update(out_ptr=partial, m_ptr=partial, l_ptr=partial)
    for name in ("block_table_ptr", "seq_lens_ptr", "query_start_ptr", "tile_seq_ptr"):
        pointers[name] = "*i32"
    pointers["tile_start_ptr"] = "*i32"
    constexprs = dict(
        stride_qd=1,
        stride_cd=1,
        stride_od=1,
        GROUP=group,
        BLOCK_SIZE=16,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim,
        BLOCK_M=block_m,
        BLOCK_Q=block_m // group,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        USE_SOFTCAP=extras,
        USE_WINDOW=extras,
        DOT_FP32=dtype == torch.float32,
        COUNT=False,
    )
    name = (
        f"attention {str(dtype).split('.')[-1]:8s} max_query_len {max_query_len:4d} "
        f"splits {splits} window+softcap {extras!s:5s} tiles {block_m}x{block_n} "
        f"warps {warps} stages {stages}"
    )
    return name, kernels._paged_attention_kernel, pointers, constexprs, warps, stages


def main() -> int:
    if not PTXAS.exists():
        print(f"no ptxas at {PTXAS}: this triton has no NVIDIA backend")
        return 2
    cases = [
        attention_case(torch.bfloat16, 1, 1, False),
        attention_case(torch.bfloat16, 1, 5, False),
        attention_case(torch.bfloat16, 4096, 1, True),
        attention_case(torch.bfloat16, 8, 1, False),
        attention_case(torch.float16, 1, 1, True),
        attention_case(torch.float32, 7, 1, True),
    ]
    bf16 = dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16")
    cases.append(
        (
            "write bf16 8 KV heads of 128",
            kernels._write_kv_kernel,
            {**bf16, "slot_ptr": "*i64"},
            dict(
                NUM_KV_HEADS=8,
                HEAD_DIM=128,
                BLOCK_SIZE=16,
                BLOCK_T=kernels.write_tokens_per_program(1024),
                BLOCK_HD=1024,
            ),
            4,
            1,
        )
    )
    partials = dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*bf16")
    cases.append(
        (
            "combine 5 splits",
            kernels._combine_splits_kernel,
            {**partials, "count_ptr": "*i32"},
            dict(NUM_SPLITS=5, SPLITS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128, COUNT=True),
            4,
            1,
        )
    )
    failed = False
    print(f"triton {triton.__version__}, sm_90, ptxas from the wheel")
    for name, kernel, pointers, constexprs, warps, stages in cases:
        try:
            report = compile_sm90(kernel, pointers, constexprs, warps, stages)
        except Exception as err:  # a compile error is this script's finding
            print(f"  {name}: FAILS to compile: {type(err).__name__}: {err}")
            failed = True
            continue
        regs = next((line for line in report.splitlines() if "registers" in line), "")
        spills = next((line for line in report.splitlines() if "spill stores" in line), "")
        count = regs.split("Used ")[-1].split(" registers")[0] if "Used " in regs else "?"
        spilled = spills.split("bytes stack frame, ")[-1].split(" bytes spill stores")[0]
        spilled = spilled.strip() if spills else "?"
        print(f"  {name}: {count} registers, {spilled} spilled")
        failed |= spilled != "0"
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
