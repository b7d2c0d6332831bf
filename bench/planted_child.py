"""One engine's planted bugs fuzzed with a fixed seed, in that engine's interpreter (run by
``bench/planted_findings.py`` and the tests of ``conformance/engine_view.py``): one JSON line per
bug, what the report names.

    python bench/planted_child.py [--no-baseline] ENGINE TESTS_DIR [SECONDS] [NAME ...]

ENGINE is ``reference`` (``tests/planted.py``, cell ``deferred``), ``nano`` (``planted_nano.py``,
in ``.venv-nano``: ``eager-unsafe``, discipline ``general``, depth 1), ``vllm``
(``planted_vllm.py``, in a vLLM venv: ``eager-unsafe``, depth 1) or ``vllm-hybrid``
(``planted_vllm_hybrid.py``, in a vLLM venv: ``hybrid.swa_factory``, ``eager-unsafe``, depth 1)
or ``vllm-mamba`` (``planted_vllm_mamba.py``, in a vLLM venv: ``hybrid.mamba_factory``,
``eager-unsafe``, fcfs, every depth) or ``vllm-window`` (``planted_vllm_window.py``, in a vLLM
venv: ``hybrid.swa_full_first_factory``, ``eager-unsafe``, depth 1);
every run is seed 0. The first
line, ``baseline``, is the engine with nothing planted under the same seed: a plant whose finding
is the baseline's is masked by the engine's own (``--no-baseline``: none). NAME: only these bugs
(and no baseline).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from typing import Any

PLANTS_OF = {
    "reference": "planted",
    "nano": "planted_nano",
    "vllm": "planted_vllm",
    "vllm-hybrid": "planted_vllm_hybrid",
    "vllm-mamba": "planted_vllm_mamba",
    "vllm-window": "planted_vllm_window",
}


def cell(engine: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``run_cell`` arguments each engine is fuzzed with (its adapter's factory)."""
    if engine == "reference":
        return ("deferred",), {}
    if engine == "nano":
        from kvspec.conformance.adapters import nano_vllm_adapter

        return ("eager-unsafe", "general"), {"depth": 1, "factory": nano_vllm_adapter.factory}
    if engine == "vllm-hybrid":
        from kvspec.conformance.adapters.vllm_adapter import hybrid

        return ("eager-unsafe",), {"depth": 1, "factory": hybrid.swa_factory}
    if engine == "vllm-window":
        from kvspec.conformance.adapters.vllm_adapter import hybrid

        return ("eager-unsafe",), {"depth": 1, "factory": hybrid.swa_full_first_factory}
    if engine == "vllm-mamba":
        from kvspec.conformance.adapters.vllm_adapter import hybrid

        return ("eager-unsafe",), {"preemption": "fcfs", "factory": hybrid.mamba_factory}
    from kvspec.conformance.adapters import vllm_adapter

    return ("eager-unsafe",), {"depth": 1, "factory": vllm_adapter.factory}


def fuzz(engine: str, patch: Any, seconds: float) -> dict[str, object]:
    from kvspec.conformance.fuzz import run_cell

    args, kw = cell(engine)
    started = time.monotonic()
    with patch():
        r = run_cell(*args, seconds=seconds, seed_value=0, **kw)
    total = time.monotonic() - started
    f = r.failure
    c = getattr(f, "consequence", None) if f else None
    return {
        "finding": None if f is None else f.finding.invariant,
        "message": None if f is None else f.finding.message,
        "named": None if c is None else c.invariant,
        "headline": None if c is None else c.headline(),
        "lost_hits": None if c is None else c.lost_hits,
        "first": r.seconds_to_failure,
        "total": total,
    }


def main() -> None:
    argv = [a for a in sys.argv[1:] if a != "--no-baseline"]
    engine, tests = argv[0], argv[1]
    seconds = float(argv[2]) if len(argv) > 2 else 30.0
    names = argv[3:]
    sys.path.insert(0, tests)
    if engine.startswith("vllm"):  # before vLLM is first imported (its platform is read then)
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    planted = importlib.import_module(PLANTS_OF[engine])
    plants = [
        *planted.PLANTS,
        *getattr(planted, "BOOKS", ()),
        *getattr(planted, "STREAM", ()),
        *getattr(planted, "CRASHING", ()),
    ]
    if not names and "--no-baseline" not in sys.argv:
        row = fuzz(engine, contextlib.nullcontext, seconds)
        print(json.dumps({"name": "baseline", "kind": "none", "expect": None, **row}), flush=True)
    for plant in plants:
        if names and plant.name not in names:
            continue
        row = fuzz(engine, plant.patch, seconds)
        print(
            json.dumps({"name": plant.name, "kind": plant.kind, "expect": plant.expect, **row}),
            flush=True,
        )


if __name__ == "__main__":
    main()
