"""A hybrid trace replayed on serving-like shapes: full attention, a sliding window and a state
group (issue #36), every output compared with the dense toy model.

The reference engine (safe ``deferred`` policy, vLLM's scheduler, priority preemption, chunked
prefill) serves requests with long shared prefixes under ``--groups`` (default: full and a
window at the hash block size, a state group at four times it); the spec judges the trace and
derives the plan (``conformance.plan``); ``impl/paged/replay.py`` replays it on paged caches
(layer ``i`` in group ``i % G``) through the Triton kernels, the window layers with the kernel's
sliding-window option over tables whose blocks before the window are nulled. Prints the trace's
hybrid figures (hits per group, nulled window blocks read around, state starts), then the
replay's steps, compared queries, max error and seconds.

    python bench/bench_replay_hybrid.py [--dtypes float32,bfloat16] [--window 512] [--prompt 2048]
    python bench/bench_replay_hybrid.py --small   # tiny shapes, for a CPU (Triton interpreter)

Exit 0 when every compared output matches, 1 at a mismatch (printed), 3 when nothing was
compared. 16-bit storage compounds its rounding through the layers (each layer's K/V are made
from the one below's output): float32 is the exact check, 16 bits the serving-like timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported


from checkout import import_kvspec  # noqa: E402

import_kvspec()

from kvspec.conformance.plan import replay_groups, replay_plan  # noqa: E402
from kvspec.impl.paged.kv_cache import DTYPES  # noqa: E402
from kvspec.impl.paged.records import Executed  # noqa: E402
from kvspec.impl.paged.replay import Options, replay, table  # noqa: E402
from kvspec.judge import Judge  # noqa: E402
from kvspec.reference import Engine, EngineConfig, GroupSpec, RandomChoices  # noqa: E402
from kvspec.reference.workload import shared_prefix_workload  # noqa: E402
from kvspec.spec import Config  # noqa: E402
from kvspec.spec.state import Group  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU)")
    parser.add_argument("--backend", default="triton", choices=("triton", "torch"))
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="storage dtypes, comma separated"
    )
    parser.add_argument("--block", type=int, default=16, help="hash block size (default 16)")
    parser.add_argument("--window", type=int, default=512, help="window W (default 512)")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, default=3, help="layers (default 3: one a group)")
    args = parser.parse_args(argv)
    if args.small:
        args.block, args.window, args.prompt, args.requests = 2, 4, 16, 8
        heads, kv_heads, head_dim = 4, 2, 16
    else:
        heads, kv_heads, head_dim = 32, 8, 128
    b = args.block
    groups = (("full", b), ("window", b, args.window), ("state", 4 * b))
    per_request = sum(-(-(args.prompt + args.max_tokens) // g[1]) for g in groups)
    common = dict(
        num_blocks=per_request * 3 + 1,  # a few requests at once: priority preempts
        block_size=b,
        depth=2,
        policy="deferred",
        discipline="vllm",
        preemption="priority",
        token_budget=max(8 * b, args.prompt // 2),  # chunked prefill
        max_running=4,
    )
    started = time.perf_counter()
    engine = Engine(
        EngineConfig(**common, groups=tuple(GroupSpec(*g) for g in groups)),  # type: ignore[arg-type]
        RandomChoices(0),
    )
    prefix = args.prompt * 3 // 4
    workload = shared_prefix_workload(
        args.requests, 2, prefix, args.prompt - prefix, args.max_tokens, 0
    )
    for rid, prompt, max_tokens, priority in workload:
        engine.add_request(rid, prompt, max_tokens, priority)
    engine.run()
    config = Config(**common, groups=tuple(Group(*g) for g in groups))  # type: ignore[arg-type]
    events = engine.events
    judge = Judge.spec(config)
    verdict = judge.feed_all(events) or judge.settle()
    plan = replay_plan(config, events)
    built = time.perf_counter() - started
    hits = [0] * len(groups)
    for e in events:
        if e[0] == "hit":
            hits[e[3] if len(e) > 3 else 0] += sum(1 for x in e[2] if x)  # type: ignore[index, union-attr]
    reads = [w for r in plan if isinstance(r, Executed) for w in r.work if w.live and not w.load]
    nulled = sum(1 for w in reads if 0 in table(w, 1)[: w.start // b])
    states = sum(1 for w in reads if w.start > 0 and w.start % (4 * b) == 0)
    print(
        f"groups {', '.join(':'.join(map(str, g)) for g in groups)}; {args.requests} requests "
        f"of {args.prompt} tokens + {args.max_tokens}; {len(events)} events, "
        f"{sum(isinstance(r, Executed) for r in plan)} steps; spec verdict "
        f"{'holds' if verdict is None else verdict}; built in {built:.1f} s"
    )
    print(
        f"hybrid paths: hit blocks per group {hits}; {nulled} step entries read a window whose "
        f"earlier blocks are nulled; {states} start from a state block at a boundary"
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    code = 0
    for name in args.dtypes.split(","):
        options = Options(
            args.backend, DTYPES[name], args.layers, heads, kv_heads, head_dim, dense_cache=16
        )
        started = time.perf_counter()
        result = replay(plan, config.num_blocks, b, options, replay_groups(config))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        print(
            f"replay on {device} ({where}), {args.backend} {name}, {options.num_layers} layers, "
            f"{heads}/{kv_heads} heads of {head_dim}: {result.steps} steps, {result.queries} "
            f"queries compared with dense attention in {seconds:.1f} s, max error "
            f"{result.max_error:.3g}"
        )
        if result.mismatch is not None:
            print(f"MISMATCH at {result.mismatch}")
            code = 1
        elif not result.queries:
            code = max(code, 3)
    return code


if __name__ == "__main__":
    sys.exit(main())
