"""Lockstep fuzzing of vLLM 0.33.0 through its adapter, beside vLLM's bare scheduler, in one run.

Three figures, each measured in a fresh process, in interleaved rounds (the order rotates round
by round, so a load on the machine hits each alike); medians over ``--rounds``:

(a) bare vLLM: the ``Scheduler`` that the adapter's ``build.py`` makes (the same ``VllmConfig``
    and KV-cache config), with nothing of kvspec attached, on the anchor workload of
    ``bench_reference.py`` (whose ``run_anchor`` drives it, as it drives the reference engine:
    ``--requests`` shared-prefix requests, 64 live, 4,096 blocks of 16 tokens), one engine step
    being one ``schedule`` and one ``update_from_output`` with a fake model runner's output (a
    token for each request whose scheduled chunk reaches the end of its tokens), as
    ``EngineCore.step`` does at depth 1. Engine steps per second.
(b) ``kvspec fuzz --target kvspec.conformance.adapters.vllm_adapter:FACTORY`` (``--policy``,
    ``--preemption``, ``--depth``, ``--seconds``, seeded by the round, ``--no-shrink``) run
    through ``kvspec.cli.main`` with engine reuse off (``KVSPEC_VLLM_REUSE=0``): each Hypothesis
    example builds its own ``VllmConfig``. Engine steps (commits) per second of the search.
(c) the same with reuse on (``vllm_adapter/reuse.py``: one ``VllmConfig`` kept per construction
    key), with the config cache's hits and misses.

Each figure per wall-clock second and per CPU second of its process (the imports excluded), and
the ratios (c)/(a), (b)/(a), (c)/(b) of the medians: the fuzzer's speed relative to the engine it
drives, and what reuse adds. The fuzzer's steps are short examples' (a few requests each), the
anchor's are steps of 64 live requests: the comparison is of what one engine step costs each way.
The children import this tree (``PYTHONPATH``), whatever the virtual environment installed.

Runs in ``.venv-vllm`` (``make thirdparty``)::

    .venv-vllm/bin/python bench/bench_vllm_fuzz.py [--seconds 15] [--rounds 3] [--depth 1]
        [--preemption fcfs] [--policy eager-unsafe] [--factory factory] [--requests 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
TARGET = "kvspec.conformance.adapters.vllm_adapter"
MODES = ("bare", "reuse off", "reuse on")
CHILDREN = {"construction": "child_construction", "bare": "child_bare"}
TITLES = {"bare": "(a) bare vLLM", "reuse off": "(b) reuse off", "reuse on": "(c) reuse on"}
SAMPLE = 1
"""The token the bare run's fake model runner samples (no stop token: requests end at their
``max_tokens``)."""


class BareScheduler:
    """vLLM's scheduler as ``bench_reference.run_anchor`` drives an engine: ``add_request``,
    ``step``, ``requests[rid].status`` and ``stats`` (steps and prefix hits; no pool counters)."""

    def __init__(self, config: Any, record: bool = False) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request

        from kvspec.conformance.adapters.vllm_adapter.build import block_hasher, build_scheduler

        self._params, self._output, self._request = SamplingParams, ModelRunnerOutput, Request
        self.scheduler = build_scheduler(config, async_scheduling=False, reuse=False)
        self.hasher = block_hasher(config.block_size)
        self.requests: dict[int, Held] = {}
        self.stats = dict.fromkeys(
            ("steps", "blocks_allocated", "blocks_touched", "blocks_freed", "hit_tokens"), 0
        )
        self.stats["prompt_tokens"] = 0
        self.cpu_started = time.process_time()  # where run_anchor starts its clock

    def add_request(
        self, rid: int, prompt: tuple[int, ...], max_tokens: int, priority: int
    ) -> None:
        request = self._request(
            request_id=str(rid),
            prompt_token_ids=list(prompt),
            sampling_params=self._params(max_tokens=max_tokens),
            pooling_params=None,
            arrival_time=float(rid),
            priority=priority,
            block_hasher=self.hasher,
        )
        self.requests[rid] = Held(request)
        self.stats["prompt_tokens"] += len(prompt)
        self.scheduler.add_request(request)

    def step(self) -> None:
        scheduler = self.scheduler
        output = scheduler.schedule()
        for new in output.scheduled_new_reqs:  # computed before this step: prefix hits
            self.stats["hit_tokens"] += new.num_computed_tokens
        live = scheduler.requests
        ids = list(output.num_scheduled_tokens)
        runner = self._output(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[] if live[r].is_prefill_chunk else [SAMPLE] for r in ids],
        )
        scheduler.update_from_output(output, runner)
        self.stats["steps"] += 1


class Held:
    """A request's status as ``run_anchor`` reads it."""

    __slots__ = ("request",)

    def __init__(self, request: Any) -> None:
        self.request = request

    @property
    def status(self) -> str:
        return "finished" if self.request.is_finished() else "live"


def child_bare(job: dict) -> dict:
    sys.path.insert(0, str(BENCH))
    from bench_reference import run_anchor

    from kvspec.spec import Config

    built: list[BareScheduler] = []

    def engine(config: Any, record: bool = False) -> BareScheduler:
        built.append(BareScheduler(config, record))
        return built[-1]

    figures = run_anchor(
        job["policy"],
        job["requests"],
        1,
        types.SimpleNamespace(EngineConfig=Config, Engine=engine),  # type: ignore[arg-type]
        preemption=job["preemption"],
    )
    return {
        "steps": built[0].stats["steps"],
        "seconds": figures["seconds"],
        "cpu": time.process_time() - built[0].cpu_started,
        "hit rate": figures["hit rate"],
    }


def child_fuzz(job: dict) -> dict:
    import importlib

    from kvspec import cli, flow

    importlib.import_module(TARGET)  # vLLM's import outside the figures
    from kvspec.conformance.adapters.vllm_adapter import reuse

    got: dict[str, Any] = {}
    fuzz = flow.fuzz

    def recording(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        result, judging = fuzz(*args, **kwargs)
        got["result"], got["cpu"] = result, time.process_time() - started
        return result, judging

    flow.fuzz = recording  # type: ignore[assignment]
    argv = ["fuzz", "--target", f"{TARGET}:{job['factory']}", "--policy", job["policy"]]
    argv += ["--preemption", job["preemption"], "--depth", str(job["depth"])]
    argv += ["--seconds", str(job["seconds"]), "--seed", str(job["seed"]), "--no-shrink"]
    code = cli.main(argv)
    result = got["result"]
    steps = sorted(result.steps_per_run)
    return {
        "exit": code,
        "steps": result.commits,
        "seconds": result.seconds,
        "cpu": got["cpu"],
        "runs": result.runs,
        "steps/run": steps[len(steps) // 2] if steps else 0,
        "found": None if result.failure is None else str(result.failure.finding.invariant),
        "hits": reuse.configs.hits,
        "misses": reuse.configs.misses,
        "reuse": reuse.enabled(),
    }


class Tokens:
    """Choices for building alone (nothing is drawn)."""

    def pick(self, n: int, label: str) -> int:
        return 1


def child_construction(job: dict) -> dict:
    """Seconds per construction, over ``job["builds"]`` builds of a small cell of the fuzzer's: a
    ``VllmConfig`` built now, and the rest of an example's engine (the adapter on a kept config:
    the ``Scheduler`` with its manager and pool, the KV-cache config, the block hasher,
    ``attach``'s wrappers, the KV-event stream)."""
    import importlib

    from kvspec.conformance.adapters.vllm_adapter import build, reuse
    from kvspec.spec import Config

    make = getattr(importlib.import_module(TARGET), job["factory"])
    config = Config(
        num_blocks=6,
        block_size=2,
        depth=job["depth"],
        token_budget=8,
        max_running=3,
        policy=job["policy"],
        preemption=job["preemption"],
        stop_token=0,
    )
    make(config, Tokens())  # the kept config, and the process's KV-event publisher, built once
    (key,) = reuse.configs.kept
    figures = {}
    for name, build_one in (
        ("config", lambda: build.new_vllm_config(*key)),
        ("rest", lambda: make(config, Tokens())),
    ):
        started = time.perf_counter()
        for _ in range(job["builds"]):
            build_one()
        figures[name] = (time.perf_counter() - started) / job["builds"]
    return figures


def tree_link() -> Path:
    """A folder whose ``kvspec`` is this tree (for the children's ``PYTHONPATH``)."""
    link = Path(tempfile.mkdtemp(prefix="kvspec-tree-"))
    (link / "kvspec").symlink_to(ROOT)
    return link


def child(link: Path, mode: str, job: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(link), "VLLM_TARGET_DEVICE": "cpu"}
    env["KVSPEC_VLLM_REUSE"] = "0" if mode == "reuse off" else "1"
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([mode, job])],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.splitlines()[-1])
    if "reuse" in got and got["reuse"] != (mode == "reuse on"):
        raise SystemExit(f"{mode}: the child ran with reuse {got['reuse']}")
    return got


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="fuzzing budget per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=1, help="the fuzzed cell's depth")
    parser.add_argument("--preemption", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--policy", default="eager-unsafe", help="the spec's policy")
    parser.add_argument("--factory", default="factory", help="a factory of vllm_adapter")
    parser.add_argument("--requests", type=int, default=10_000, help="the anchor's requests")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, job = json.loads(args.child)
        run = globals()[CHILDREN.get(mode, "child_fuzz")]
        print(json.dumps(run(job)), flush=True)
        return

    from importlib.metadata import version

    link = tree_link()
    bare_job = dict(policy=args.policy, preemption=args.preemption, requests=args.requests)
    fuzz_job = dict(
        factory=args.factory,
        policy=args.policy,
        preemption=args.preemption,
        depth=args.depth,
        seconds=args.seconds,
    )
    command = (
        f"kvspec fuzz --target {TARGET}:{args.factory} --policy {args.policy} --preemption "
        f"{args.preemption} --depth {args.depth} --seconds {args.seconds:g} --no-shrink"
    )
    print(
        f"vLLM {version('vllm')}, kvspec from {ROOT}; median of {args.rounds} interleaved "
        f"rounds, each figure in a fresh process; load average at start {load()}"
    )
    print(
        f"(a) bare vLLM Scheduler, anchor workload: {args.requests} requests, 20 x 512-token "
        f"shared prompts + 64 unique, 32 decoded, 64 live, 4096 blocks of 16, depth 1, "
        f"{args.preemption}"
    )
    print(f"(b), (c) {command}, seed = round; (b) KVSPEC_VLLM_REUSE=0, (c) reuse on")
    got: dict[str, list[dict]] = {mode: [] for mode in (*MODES, "construction")}
    for r in range(args.rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            job = bare_job if mode == "bare" else {**fuzz_job, "seed": r}
            got[mode].append(child(link, mode, job))
        got["construction"].append(child(link, "construction", {**fuzz_job, "builds": 200}))

    def med(mode: str, key: str) -> float:
        return float(statistics.median(g[key] for g in got[mode]))

    def rate(mode: str, clock: str) -> float:
        return float(statistics.median(g["steps"] / g[clock] for g in got[mode]))

    def row(key: str, form: str, only: tuple[str, ...] = MODES) -> dict[str, str]:
        return {m: format(med(m, key), form) if m in only else "-" for m in MODES}

    rows: list[tuple[str, dict[str, str]]] = [
        ("engine steps/s (wall)", {m: f"{rate(m, 'seconds'):,.0f}" for m in MODES}),
        ("engine steps/s (CPU)", {m: f"{rate(m, 'cpu'):,.0f}" for m in MODES}),
        ("engine steps", row("steps", ",.0f")),
        ("seconds", row("seconds", ".1f")),
        ("examples (runs)", row("runs", ",.0f", MODES[1:])),
        ("engine steps/run median", row("steps/run", ".0f", MODES[1:])),
        ("config cache hits", row("hits", ",.0f", MODES[1:])),
        ("config cache misses", row("misses", ",.0f", MODES[1:])),
        ("prefix hit rate", row("hit rate", ".1%", ("bare",))),
    ]
    print(f"\n  {'':26s}" + "".join(f"{TITLES[m]:>16s}" for m in MODES))
    for name, cells in rows:
        print(f"  {name:26s}" + "".join(f"{cells[m]:>16s}" for m in MODES))
    print("  per round, engine steps/s (wall):")
    for m in MODES:
        each = ", ".join(f"{g['steps'] / g['seconds']:,.0f}" for g in got[m])
        print(f"    {TITLES[m]:16s} {each}")
    found = {g["found"] for m in MODES[1:] for g in got[m]} - {None}
    if found:
        print(f"  findings (a run ends at its first): {', '.join(sorted(found))}")

    print(f"\n  {'ratio of the medians':30s}{'wall':>10s}{'CPU':>10s}")
    for top, bottom in (("reuse on", "bare"), ("reuse off", "bare"), ("reuse on", "reuse off")):
        name = f"{TITLES[top][:3]}/{TITLES[bottom][:3]} {top} / {bottom}"
        wall = rate(top, "seconds") / rate(bottom, "seconds")
        cpu = rate(top, "cpu") / rate(bottom, "cpu")
        print(f"  {name:30s}{wall:>9.2f}x{cpu:>9.2f}x")
    config, rest = med("construction", "config") * 1e3, med("construction", "rest") * 1e3
    print(
        f"\n  construction per example ({args.factory}, 6 blocks of 2, median of the rounds' "
        f"means over 200 builds): VllmConfig {config:.2f} ms, the rest of the engine on a kept "
        f"config (Scheduler, attach, KV-event stream) {rest:.2f} ms"
    )
    print(f"\nload average at end {load()}")


if __name__ == "__main__":
    main()
