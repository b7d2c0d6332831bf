"""vLLM's KV-event stream of a hybrid model (``hybrid.swa_factory``: a sliding-window group beside
a full-attention one), judged in process on a fixed workload and again from its capture file by
``kvspec check --kv-events``; run inside each vLLM venv by ``tests/test_kv_stream_hybrid.py``.

``python tests/kv_stream_hybrid_checks.py DIR [PLANT]`` prints one line per depth (1, then 2):
the in-process finding or ``none``, the batches and events judged, the groups that
``BlockStored`` and ``BlockRemoved`` named (vLLM's ``group_idx``), the kinds stored, and the exit
code of ``kvspec check --kv-events`` on the capture written under DIR. PLANT: a name from
``planted_vllm_hybrid.STREAM``, applied while the engine runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kv_stream_checks import WORKLOAD, drive  # noqa: E402
from thirdparty_checks import Ones  # noqa: E402

from kvspec.cli import main  # noqa: E402
from kvspec.conformance.adapters.vllm_adapter import hybrid  # noqa: E402
from kvspec.conformance.kvevents.frames import decode_batch  # noqa: E402
from kvspec.judge import Judge  # noqa: E402
from kvspec.spec import Config  # noqa: E402
from kvspec.spec.stream import Removed, Stored  # noqa: E402

CELL = dict(num_blocks=10, block_size=4, token_budget=16, max_running=4, policy="eager-unsafe")


def run(folder: Path, depth: int, plant: Any) -> str:
    config = Config(**CELL, depth=depth, stop_token=0)  # type: ignore[arg-type]
    with plant():
        adapter = hybrid.swa_factory(config, Ones())
        judge = Judge.spec(adapter.config, False)
        finding = drive(adapter, judge, WORKLOAD)
    stream = adapter.kv_stream.engine
    stored: set[int | None] = set()
    removed: set[int | None] = set()
    kinds: set[str | None] = set()
    for frame in stream.frames:
        for event in decode_batch(frame.seq, frame.payload).events:
            if isinstance(event, Stored):
                stored.add(event.group)
                kinds.add(event.kind)
            elif isinstance(event, Removed):
                removed.add(event.group)
    capture = folder / f"swa-depth{depth}.kvcap"
    stream.write_capture(capture)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(["check", "--kv-events", str(capture)])
    said = "none" if finding is None else f"{finding.invariant}: {finding.message}"
    checked = out.getvalue().strip().splitlines()[:1]
    totals = stream.judge.stats
    return (
        f"{said} | {totals.batches} batches {totals.events} events | stored groups "
        f"{sorted(stored, key=str)} removed groups {sorted(removed, key=str)} kinds "
        f"{sorted(kinds, key=str)} | check exit {code}: {checked[0] if checked else ''}"
    )


if __name__ == "__main__":
    where = Path(sys.argv[1])
    plant: Any = contextlib.nullcontext
    if len(sys.argv) > 2:
        from planted_vllm_hybrid import STREAM

        plant = next(p.patch for p in STREAM if p.name == sys.argv[2])
    for depth in (1, 2):
        print(run(where, depth, plant), flush=True)
