"""What ``kvspec fuzz`` makes SGLang 0.5.23's overlap scheduler do: the fuzzer run on the adapter's
factory as usual, with every engine it builds kept, then the events of all of them counted, with
the orders that only overlap has counted apart (``docs/adapters.md``, "SGLang 0.5.23").

    .venv-sglang/bin/python bench/fuzz_sglang_coverage.py --seconds 120 --seed 3 [--sync] [--swa]
    .venv-sglang/bin/python bench/fuzz_sglang_coverage.py --seconds 60 --mamba [--retract]
    .venv-sglang/bin/python bench/fuzz_sglang_coverage.py --seconds 60 --mamba --extra fixed

``--swa``: the hybrid sliding-window model (``swa_factory``, ``swa_sync_factory``), with a second
line of the hybrid paths its recorder counted (``SwaRecorder.paths``: hits SGLang cut back by
the window, window blocks given up while their SWA page is in the tree, ...) and the let-gos
(``dedup`` to the null block) of a request a submitted step holds.

``--mamba``: the hybrid linear-attention model (``mamba_factory``: no_buffer, the loop without
overlap, depth 1), with a second line of the MAMBA paths its recorder counted
(``MambaRecorder.paths``: admissions, states hit by copy, snapshots by copy and by donation,
copies dropped where the node had a state, evictions of states), and a third, the fuzzer's own
``groups_line`` (``conformance/fuzz_coverage.py``: the same paths read from the judged events
alone, which must agree with the recorder's); ``--retract`` runs it in SGLang's retraction test
mode (``mamba_retract_factory``). ``--mamba --extra sglang|fixed``:
Qwen3-Next's ``extra_buffer`` under the overlap loop (depth 2, ``mamba_extra_factory``, or
``mamba_extra_fixed_factory`` with the ping-pong flip SGLang misses after a prefill), its second
line ``ExtraRecorder.paths`` (track writes, track donations, finished donations, ...).

Prints the fuzzer's verdict line and one line of counts. "In flight" means: while a step that
was submitted and has not executed yet holds the request (SGLang's batch N+1, launched before
batch N's result is processed):

* ``decodes on a placeholder``: a ``schedule`` of a request that a submitted step not yet
  committed samples (batch N+1 decoding on the token N samples);
* ``inserts in flight``: ``publish`` of a request a submitted, unexecuted step holds;
* ``dedups in flight``: ``dedup`` of such a request (the copy dropped while N+1 reads it);
* ``retractions in flight``: ``preempt`` of such a request (its pages freed while N+1 reads them).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from kvspec import flow
from kvspec.conformance.adapters import sglang_adapter
from kvspec.reference.choices import Choices
from kvspec.spec import Config

TALLY: Counter[str] = Counter()
PATHS: Counter[str] = Counter()
"""The hybrid paths of every SWA or MAMBA engine built (``SwaRecorder.paths``,
``MambaRecorder.paths``)."""
LAST: list[Any] = []
"""The engine built last, counted when the next one is built (or at the end)."""


def keep(adapter: Any) -> Any:
    for engine in LAST:
        count(engine.events, TALLY)
        PATHS.update(getattr(engine.scheduler.record, "paths", {}))
    LAST[:] = [] if adapter is None else [adapter]
    TALLY["engines"] += 1
    return adapter


def factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.factory(config, choices))


def sync_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.sync_factory(config, choices))


def swa_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.swa_factory(config, choices))


def swa_sync_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.swa_sync_factory(config, choices))


def mamba_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.mamba_factory(config, choices))


def mamba_retract_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.mamba_retract_factory(config, choices))


def mamba_extra_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.mamba_extra_factory(config, choices))


def mamba_extra_fixed_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.mamba_extra_fixed_factory(config, choices))


def mamba_extra_retract_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.mamba_extra_retract_factory(config, choices))


def mamba_extra_fixed_retract_factory(config: Config, choices: Choices) -> Any:
    return keep(sglang_adapter.mamba_extra_fixed_retract_factory(config, choices))


def count(events: list[tuple[object, ...]], tally: Counter[str]) -> None:
    """Add one engine's events to ``tally``."""
    holds: dict[object, set[object]] = {}  # step -> the requests it schedules
    submitted: set[object] = set()  # submitted, not executed
    uncommitted: set[object] = set()  # submitted, not committed
    building: object = None
    for event in events:
        kind = event[0]
        tally[str(kind)] += 1
        if kind == "begin":
            building = event[1]
            holds[building] = set()
        elif kind == "schedule":
            rid = event[1]
            if any(rid in holds[s] for s in uncommitted):
                tally["decodes on a placeholder"] += 1
            holds[building].add(rid)
        elif kind == "submit":
            submitted.add(event[1])
            uncommitted.add(event[1])
        elif kind == "execute":
            submitted.discard(event[1])
        elif kind == "commit":
            uncommitted.discard(event[1])
        elif kind in ("publish", "dedup", "preempt"):
            rid = event[1]
            if any(rid in holds[s] for s in submitted):
                name = {"publish": "inserts", "dedup": "dedups", "preempt": "retractions"}[kind]
                if kind == "dedup" and event[3] == 0:
                    name = "let-gos"
                tally[f"{name} in flight"] += 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", action="store_true", help="the loop without overlap, depth 1")
    parser.add_argument("--swa", action="store_true", help="the hybrid sliding-window model")
    parser.add_argument(
        "--mamba", action="store_true", help="the hybrid linear-attention model (depth 1)"
    )
    parser.add_argument(
        "--retract", action="store_true", help="with --mamba: SGLang's retraction test mode"
    )
    parser.add_argument(
        "--extra",
        choices=("sglang", "fixed"),
        help="with --mamba: Qwen3-Next's extra_buffer under overlap (depth 2): SGLang as it is "
        "(mamba_extra_factory), or with the ping-pong flip it misses after a prefill "
        "(mamba_extra_fixed_factory); with --retract in SGLang's retraction test mode",
    )
    args = parser.parse_args(argv)
    if args.mamba and args.swa:
        parser.error("--mamba and --swa are two models: one at a time")
    if args.extra and not args.mamba:
        parser.error("--extra is a strategy of the --mamba model")
    sync = args.sync or (args.mamba and not args.extra)
    cell = flow.Cell("engine-registers", "general", depth=1 if sync else 2)
    name = ("swa_" if args.swa else "") + ("sync_factory" if sync else "factory")
    if args.mamba:
        name = "mamba_retract_factory" if args.retract else "mamba_factory"
    if args.extra:
        name = "mamba_extra_" + ("fixed_" if args.extra == "fixed" else "")
        name += "retract_factory" if args.retract else "factory"
    target = f"__main__:{name}"
    result, _ = flow.fuzz(cell, args.seconds, args.seed, None, target)
    keep(None)
    tally = TALLY
    failure = result.failure
    verdict = "no counterexample" if failure is None else f"COUNTEREXAMPLE: {failure.finding}"
    print(
        f"{verdict} in {result.seconds:.0f} s, seed {args.seed}: {result.runs:,} runs, "
        f"{result.commits:,} engine steps, {tally['engines'] - 1:,} engines built"
    )
    keys = [
        "begin",
        "schedule",
        "decodes on a placeholder",
        "publish",
        "inserts in flight",
        "dedup",
        "dedups in flight",
        "preempt",
        "retractions in flight",
        "snapshot",
        "track",
        "evict",
        "unpublish",
        "abort",
        "finish",
        "reset",
    ]
    print(", ".join(f"{tally[k]:,} {k}" for k in keys))
    if args.swa or args.mamba:
        extra = {} if args.mamba else {"let-gos in flight": tally["let-gos in flight"]}
        paths = sorted({**PATHS, **extra}.items())
        print(", ".join(f"{count:,} {path}" for path, count in paths))
        print(result.coverage.groups_line())  # the same paths, read from the judged events
    return 0 if failure is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
