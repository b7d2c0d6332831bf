"""A bounded slice of the hostile-input campaign (bench/hostile.py): corrupted traces through every
reader and generated command lines, judged by its independent oracle; none may end in a
traceback, a wrong exit code or a silent acceptance. The full campaign is run by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "hostile.py"


def load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("hostile", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def test_a_slice_of_the_hostile_campaign_is_clean() -> None:
    hostile = load()
    tally = hostile.campaign(traces=100, commands=20, seed_value=0, limit=4.0)
    assert tally.cases["trace"] >= 100 and tally.cases["command"] == 20
    assert tally.clean, tally.failures[:3]


def test_the_oracle_catches_a_reader_that_accepts_too_much(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A planted leniency (unknown event kinds read as resets) must show as silent acceptance."""
    from kvspec.conformance import trace

    hostile = load()
    real = trace.parse_object

    def lenient(obj: object, num_blocks: int):  # type: ignore[no-untyped-def]
        if isinstance(obj, dict) and obj.get("ev") not in trace.FIELDS:
            return ("reset",), None
        return real(obj, num_blocks)

    monkeypatch.setattr(trace, "parse_object", lenient)
    monkeypatch.setattr(trace, "parse_line", lambda raw, n: lenient(__import__("orjson").loads(raw), n))  # fmt: skip
    tally = hostile.Tally()
    folder = Path(__import__("tempfile").mkdtemp())
    lines = hostile.base_traces(folder)["safe-v1"]
    bad = b"\n".join(lines[:1] + [b'{"ev":"teleport"}'] + lines[1:]) + b"\n"
    hostile.judge_trace(bad, folder / "case.jsonl", tally)
    assert tally.silent + tally.wrong_codes >= 1, tally
