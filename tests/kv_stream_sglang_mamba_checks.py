"""SGLang 0.5.23's own KV-event stream of its hybrid linear-attention tree (``sglang_adapter``'s
``mamba_factory``: ``UnifiedRadixCache`` with FULL and MAMBA, ``no_buffer``, depth 1), judged in
process on fixed workloads and again from its capture file by ``kvspec check --kv-events``; run
inside ``.venv-sglang`` by ``tests/test_kv_stream_hybrid.py``, one process for every run.

``python tests/kv_stream_sglang_mamba_checks.py DIR`` prints one line per run: the workload and
the fault planted in what SGLang's tree hands its publisher (``take_events``) or ``clean``, the
in-process finding or ``none``, the batches, events and step boundaries judged, the groups and
media stores named, the boundaries where the view announced a page no tree state's key extends
(``kv_stream.count_stateless``) and how many such pages, the MAMBA paths the recorder saw (states
hit, snapshots by copy and by donation, state evictions), the same three as the fuzzer's
generic counters read them from the adapter's events (``fuzz_coverage.RunCoverage``: slot hits,
snapshots by copy, by donation), and the exit code and first line of
``kvspec check --kv-events`` on the capture written under DIR. Faults (the ``WORKLOAD`` run
only): ``lost-store`` and ``unannounced-parent`` (``kv_stream_sglang_swa_checks.plant``), and
``double-removal`` (the first ``BlockRemoved`` is sent twice).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from kv_stream_checks import SHORT, WORKLOAD  # noqa: E402
from kv_stream_sglang_swa_checks import SHARED, judged, plant  # noqa: E402
from thirdparty_checks import Ones  # noqa: E402

from kvspec.conformance.adapters import sglang_adapter  # noqa: E402
from kvspec.conformance.fuzz_coverage import RunCoverage  # noqa: E402
from kvspec.spec import Config  # noqa: E402

CELL = dict(num_blocks=5, block_size=4, token_budget=16, max_running=2)  # 16 pages: evictions
TIGHT = dict(num_blocks=6, block_size=2, token_budget=8, max_running=2)  # 10 pages
HIT = [  # each prompt extends the one before: its state is hit, copied into the new slot
    ("arrive", (0, (1, 2, 3, 4, 5, 6), 2, 0)),
    ("step", (12,)),
    ("arrive", (1, (1, 2, 3, 4, 5, 6, 7, 8), 2, 0)),
    ("step", (12,)),
    ("arrive", (2, (1, 2, 3, 4, 5, 6, 7, 8, 9, 9), 2, 0)),
    ("arrive", (3, (1, 2, 3, 4, 5, 6, 7, 8), 2, 0)),
    ("step", (12,)),
]
RUNS = [
    ("WORKLOAD", WORKLOAD, CELL, None),
    ("SHORT", SHORT, TIGHT, None),
    ("SHARED", SHARED, TIGHT, None),
    ("HIT", HIT, CELL, None),
    ("WORKLOAD", WORKLOAD, CELL, "lost-store"),
    ("WORKLOAD", WORKLOAD, CELL, "unannounced-parent"),
    ("WORKLOAD", WORKLOAD, CELL, "double-removal"),
]
PATHS = ("states hit by copy", "snapshots by copy", "snapshots by donation", "state evictions")


def double_removal(adapter: Any) -> None:
    """Wrap what SGLang's tree hands the publisher: the first ``BlockRemoved`` goes out twice."""
    stream = adapter.kv_stream
    take = stream.tree.take_events
    done: list[int] = []

    def take_events() -> list[Any]:
        events = take()
        for i, event in enumerate(events):
            if not done and type(event).__name__ == "BlockRemoved":
                events.insert(i + 1, event)
                done.append(i)
                break
        return events

    stream.tree.take_events = take_events


def run(folder: Path, label: str, workload: Any, cell: Any, fault: str | None) -> str:
    config = Config(policy="engine-registers", discipline="general", stop_token=0, depth=1, **cell)
    adapter = sglang_adapter.mamba_factory(config, Ones())
    if fault == "double-removal":
        double_removal(adapter)
    elif fault is not None:
        plant(adapter, fault)
    capture = folder / f"mamba-{label}-{fault or 'clean'}.kvcap"
    said, stats, where, totals, code, checked = judged(adapter, capture, workload)
    paths = adapter.scheduler.record.paths
    generic = RunCoverage(tuple(g.kind for g in adapter.config.groups))
    generic.observe(adapter.events)  # the fuzzer's counters, from the judged events alone
    counted = (generic.slot_hits, generic.snapshots_copied, generic.snapshots_donated)
    return (
        f"mamba_factory {label} {fault or 'clean'} | {said} | {stats.batches} batches "
        f"{stats.events} events {stats.boundaries} boundaries | stored in "
        f"{sorted(where, key=str)} | "
        f"{totals.get('boundaries announcing pages no state extends', 0)} stateless boundaries "
        f"{totals.get('pages no state extends announced at a boundary', 0)} pages | "
        + ", ".join(f"{paths[p]} {p}" for p in PATHS)
        + " | events: {} {} {}".format(*counted)
        + f" | check exit {code}: {checked[0] if checked else ''}"
    )


if __name__ == "__main__":
    where = Path(sys.argv[1])
    for label, workload, cell, fault in RUNS:
        print(run(where, label, workload, cell, fault), flush=True)
