"""vLLM's KV-event stream of a hybrid model (``hybrid.swa_factory``: a sliding-window group beside
a full-attention one; ``hybrid.mamba_factory``: a Mamba ``align`` state group beside one), judged
in process on a fixed workload and again from its capture file by ``kvspec check --kv-events``;
run inside each vLLM venv by ``tests/test_kv_stream_hybrid.py``.

``python tests/kv_stream_hybrid_checks.py DIR MODEL [PLANT]`` (MODEL ``swa`` or ``mamba``) prints
one line per depth (1, then 2): the in-process finding or ``none``, the batches and events
judged, the groups that ``BlockStored`` and ``BlockRemoved`` named (vLLM's ``group_idx``), the
kinds stored, the Mamba stores with more tokens than hashes (``known_findings.sparse``) and the
known findings the judge read by name, and the exit code and first line of ``kvspec check
--kv-events`` on the capture written under DIR, then of the same with ``--known
vllm-mamba-store-tokens``. PLANT: a name from ``planted_vllm_hybrid.STREAM``, applied while the
engine runs.
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
from kvspec.conformance.kvevents.known_findings import MAMBA_STORE_TOKENS, sparse  # noqa: E402
from kvspec.judge import Judge  # noqa: E402
from kvspec.spec import Config  # noqa: E402
from kvspec.spec.stream import Removed, Stored  # noqa: E402

CELL = dict(num_blocks=10, block_size=4, token_budget=16, max_running=4, policy="eager-unsafe")


def run(folder: Path, model: str, depth: int, plant: Any) -> str:
    config = Config(**CELL, depth=depth, stop_token=0)  # type: ignore[arg-type]
    with plant():
        adapter = getattr(hybrid, f"{model}_factory")(config, Ones())
        judge = Judge.spec(adapter.config, False)
        finding = drive(adapter, judge, WORKLOAD)
    stream = adapter.kv_stream.engine
    stored: set[int | None] = set()
    removed: set[int | None] = set()
    kinds: set[str | None] = set()
    sparse_stores = 0
    for frame in stream.frames:
        for event in decode_batch(frame.seq, frame.payload).events:
            sparse_stores += sparse(event)
            if isinstance(event, Stored):
                stored.add(event.group)
                kinds.add(event.kind)
            elif isinstance(event, Removed):
                removed.add(event.group)
    capture = folder / f"{model}-depth{depth}.kvcap"
    stream.write_capture(capture)
    said = "none" if finding is None else f"{finding.invariant}: {finding.message}"
    totals, known = stream.judge.stats, stream.judge.known.seen
    return (
        f"{said} | {totals.batches} batches {totals.events} events | stored groups "
        f"{sorted(stored, key=str)} removed groups {sorted(removed, key=str)} kinds "
        f"{sorted(kinds, key=str)} sparse {sparse_stores} known {dict(known)} | "
        f"{check(capture)} | {check(capture, '--known', MAMBA_STORE_TOKENS)}"
    )


def check(capture: Path, *options: str) -> str:
    """``kvspec check --kv-events`` on a capture: its exit code and first line."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(["check", "--kv-events", str(capture), *options])
    lines = out.getvalue().strip().splitlines()[:1]
    return f"check exit {code}: {lines[0] if lines else ''}"


if __name__ == "__main__":
    where, model = Path(sys.argv[1]), sys.argv[2]
    plant: Any = contextlib.nullcontext
    if len(sys.argv) > 3:
        from planted_vllm_hybrid import STREAM

        plant = next(p.patch for p in STREAM if p.name == sys.argv[3])
    for depth in (1, 2):
        print(run(where, model, depth, plant), flush=True)
