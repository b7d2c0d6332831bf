"""SGLang 0.5.23's own KV-event stream of its hybrid sliding-window tree (``sglang_adapter``'s
``swa_factory``, overlap loop, and ``swa_sync_factory``: ``UnifiedRadixCache`` with FULL and SWA),
judged in process on fixed workloads and again from its capture file by ``kvspec check
--kv-events``; run inside ``.venv-sglang`` by ``tests/test_kv_stream_hybrid.py``.

``python tests/kv_stream_sglang_swa_checks.py DIR [PLANT]`` prints one line per run: the factory
and workload, the in-process finding or ``none``, the batches, events and step boundaries judged,
the groups and media stores named, the boundaries where the view announced a page whose SWA value
SGLang had evicted (a tombstone) and how many such pages, and the exit code and first line of
``kvspec check --kv-events`` on the capture written under DIR (the whole stream, also after an
in-process violation). PLANT (the ``WORKLOAD`` runs only), applied to what SGLang's
tree hands its publisher (``take_events``): ``lost-store`` (the first ``BlockStored`` with two
hashes or more is lost), ``unannounced-parent`` (the first ``BlockStored`` with a parent names
a hash never announced instead).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from kv_stream_checks import SHORT, WORKLOAD, drive  # noqa: E402
from thirdparty_checks import Ones  # noqa: E402

from kvspec.cli import main  # noqa: E402
from kvspec.conformance.adapters import sglang_adapter  # noqa: E402
from kvspec.conformance.kvevents import engine_stream  # noqa: E402
from kvspec.conformance.kvevents.frames import decode_batch  # noqa: E402
from kvspec.judge import Judge  # noqa: E402
from kvspec.spec import Config  # noqa: E402
from kvspec.spec.stream import Stored  # noqa: E402

BIG = dict(num_blocks=12, block_size=4, token_budget=16, max_running=4)
SMALL = dict(num_blocks=6, block_size=2, token_budget=8, max_running=2)
TIGHT = dict(num_blocks=7, block_size=2, token_budget=8, max_running=3)
SHARED = [  # prompts sharing a long prefix on a small pool: SWA values evicted under the FULL ones
    ("arrive", (0, (1, 2, 3, 1, 2, 3, 1, 2, 3), 2, 0)),
    ("step", (12,)),
    ("arrive", (1, (1, 2, 3, 1, 2, 3, 3, 3, 3), 2, 0)),
    ("step", (12,)),
    ("arrive", (2, (1, 2, 3, 1, 2, 2, 2, 2), 2, 0)),
    ("arrive", (3, (2, 2, 2, 2, 2), 2, 0)),
    ("step", (20,)),
    ("arrive", (4, (1, 2, 3, 1, 2, 3, 1, 2), 2, 0)),
    ("step", (20,)),
]
RUNS = [
    ("swa_factory", 2, "WORKLOAD", WORKLOAD, BIG),
    ("swa_factory", 2, "SHORT", SHORT, SMALL),
    ("swa_factory", 2, "SHARED", SHARED, TIGHT),
    ("swa_sync_factory", 1, "WORKLOAD", WORKLOAD, BIG),
    ("swa_sync_factory", 1, "SHARED", SHARED, TIGHT),
]
UNANNOUNCED = 0x5EED5EED
"""The parent ``unannounced-parent`` names."""


def plant(adapter: Any, name: str) -> None:
    """Wrap what SGLang's tree hands the publisher: the first store it fits is changed."""
    stream = adapter.kv_stream
    take = stream.tree.take_events
    done = []

    def take_events() -> list[Any]:
        events = take()
        for i, event in enumerate(events):
            if done or type(event).__name__ != "BlockStored":
                continue
            if name == "lost-store" and len(event.block_hashes) >= 2:
                del events[i]
                done.append(i)
            elif name == "unannounced-parent" and event.parent_block_hash is not None:
                event.parent_block_hash = UNANNOUNCED
                done.append(i)
        return events

    stream.tree.take_events = take_events


def judged(adapter: Any, capture: Path, workload: Any) -> tuple[str, Any, set[Any], dict[str, int], int, list[str]]:  # fmt: skip
    """Drive ``workload`` judged by the spec with SGLang's stream attached; write the stream's
    capture to ``capture`` and read it back through ``kvspec check --kv-events``. Returns what the
    spec said, the stream judge's stats, the (medium, group) pairs stores named, the stream
    counters this run moved, and the check's exit code and first line."""
    judge = Judge.spec(adapter.config, True)
    before = dict(engine_stream.TOTALS)
    finding = drive(adapter, judge, workload, to_end=True)
    stream = adapter.kv_stream.engine
    where: set[tuple[str | None, int | None]] = set()
    for frame in stream.frames:
        for event in decode_batch(frame.seq, frame.payload).events:
            if isinstance(event, Stored):
                where.add((event.medium, event.group))
    stream.write_capture(capture)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(["check", "--kv-events", str(capture)])
    checked = out.getvalue().strip().splitlines()[:1]
    said = "none" if finding is None else f"{finding.invariant}: {finding.message}"
    totals = {k: v - before.get(k, 0) for k, v in engine_stream.TOTALS.items()}
    return said, stream.judge.stats, where, totals, code, checked


def run(folder: Path, factory: str, depth: int, label: str, workload: Any, cell: Any, fault: str | None) -> str:  # fmt: skip
    config = Config(
        policy="engine-registers", discipline="general", stop_token=0, depth=depth, **cell
    )
    adapter = getattr(sglang_adapter, factory)(config, Ones())
    if fault is not None:
        plant(adapter, fault)
    said, stats, where, totals, code, checked = judged(
        adapter, folder / f"{factory}-{label}.kvcap", workload
    )
    return (
        f"{factory} depth {depth} {label} | {said} | {stats.batches} batches {stats.events} "
        f"events {stats.boundaries} boundaries | stored in {sorted(where, key=str)} | "
        f"{totals.get('boundaries announcing SWA-tombstoned pages', 0)} tombstone boundaries "
        f"{totals.get('SWA-tombstoned pages announced at a boundary', 0)} pages | "
        f"check exit {code}: {checked[0] if checked else ''}"
    )


if __name__ == "__main__":
    where = Path(sys.argv[1])
    fault = sys.argv[2] if len(sys.argv) > 2 else None
    for factory, depth, label, workload, cell in RUNS:
        if fault is not None and label != "WORKLOAD":  # the workload whose stores have parents
            continue
        print(run(where, factory, depth, label, workload, cell, fault), flush=True)
