"""One carrier for what runs (issue #32): a configuration field added in one place, ``Cell``
(``cell.py``), reaches the command line's flag, the spec's ``Config`` of every fuzzed run, the
trace header and back, the verdict table's row and the fuzzer's name for the cell; a field the
reference engine has no setting for is refused, never ignored.

Each test copies the package, makes the one edit in the copy and runs the copy in a child
process (the derivations are made when the modules load)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.cell import Cell
from kvspec.conformance import trace, verdicts

ROOT = Path(__file__).resolve().parent.parent
NOT_PACKAGE = ("tests", "bench", "docs", "build", "dist", "examples", "thirdparty", "tools")

DEFER_FREE = """    defer_free: bool = _setting(
        False,
        Flag(
            "--defer-free",
            "deferred block frees (vLLM's defer_block_free)",
            commands=(FUZZ,),
            argparse={"action": "store_true"},
            shown=lambda value: "deferred frees",
        ),
    )
"""
"""A field ``Cell`` does not have today (``Config.defer_free`` is the spec's, with no flag)."""

WIDGET_CONFIG = '''    widget: int = 0
    """A new constant of the model (the test's)."""
'''
WIDGET_CELL = """    widget: int = _setting(
        0,
        Flag("--widget", "a new setting", commands=(FUZZ,), argparse={"type": int}),
    )
"""


def _copy(tmp_path: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """The package copied under ``tmp_path/pp/kvspec``, each file of ``edits`` with its text
    inserted before its anchor (which must be there once); the ``PYTHONPATH`` to import it."""
    target = tmp_path / "pp" / "kvspec"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "tests", ".*")
    target.mkdir(parents=True)
    for path in ROOT.glob("*.py"):
        shutil.copy(path, target / path.name)
    for folder in ROOT.iterdir():  # the package's folders, wherever the layout puts them
        if folder.is_dir() and not folder.name.startswith(".") and folder.name not in NOT_PACKAGE:
            shutil.copytree(folder, target / folder.name, ignore=ignore)
    for name, (anchor, text) in edits.items():
        source = (target / name).read_text()
        assert source.count(anchor) == 1, f"{name}: the anchor {anchor!r} moved"
        (target / name).write_text(source.replace(anchor, text + anchor))
    return tmp_path / "pp"


def _run(pythonpath: Path, script: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "KVSPEC_PURE_PYTHON": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


CELL_ANCHOR = "\n    @property\n    def overlaps(self) -> bool:"


def test_a_field_added_to_cell_reaches_flag_config_trace_row_and_runs(tmp_path: Path) -> None:
    pythonpath = _copy(tmp_path, {"cell.py": (CELL_ANCHOR, "\n" + DEFER_FREE.rstrip("\n"))})
    out = _run(
        pythonpath,
        """
import kvspec.cell, kvspec.cli as cli
from kvspec import flow
from kvspec.conformance import fuzz, verdicts
from kvspec.conformance.trace import header_for, _v1_header
import os
assert kvspec.cell.__file__.startswith(os.environ["PYTHONPATH"]), kvspec.cell.__file__
args = cli.build_parser().parse_args(["fuzz", "--policy", "deferred", "--defer-free"])
cell = kvspec.cell.Cell.from_args(args)
config = cell.config(num_blocks=8, block_size=4)
print("config", config.defer_free)
back, _ = _v1_header(header_for(config, ("e", "1")), "x")
print("trace", back.defer_free)
print("row", verdicts.columns(cell)[3])
print("name", cell.name())
seen = []
def recording(config, choices):
    seen.append(config.defer_free)
    return fuzz.reference(config, choices)
result = fuzz.fuzz_cell(cell, seconds=2.0, factory=recording)
print("runs", result.runs > 0 and all(seen) and bool(seen), result.defer_free)
machine = fuzz.cell_machine(cell)
print("tag", machine.__name__)
""",
    )
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines == {
        "config": "True",
        "trace": "True",
        "row": "sync, deferred frees",
        "name": "deferred (vllm/fcfs, deferred frees)",
        "runs": "True True",
        "tag": "Lockstep[deferred,vllm,fcfs,D,defer_free=True]",
    }, out


def test_a_new_spec_field_reaches_the_trace_and_the_reference_engine_refuses_it(
    tmp_path: Path,
) -> None:
    config_anchor = "\n    def __post_init__(self) -> None:\n        from .policies import POLICIES"
    pythonpath = _copy(
        tmp_path,
        {
            "spec/state.py": (config_anchor, "\n" + WIDGET_CONFIG.rstrip("\n")),
            "cell.py": (CELL_ANCHOR, "\n" + WIDGET_CELL.rstrip("\n")),
        },
    )
    out = _run(
        pythonpath,
        """
import kvspec.cli as cli
from kvspec import flow
from kvspec.cell import Cell
from kvspec.conformance.trace import header_for, _v1_header, TraceError
args = cli.build_parser().parse_args(["fuzz", "--policy", "deferred", "--widget", "3"])
config = Cell.from_args(args).config(num_blocks=8, block_size=4)
header = header_for(config, ("e", "1"))
print("written", header["model"]["widget"])
print("default-unwritten", "widget" not in header_for(Cell("deferred").probe_config(), ("e", "1"))["model"])
print("read", _v1_header(header, "x")[0].widget)
header["model"]["widget"] = "three"
try:
    _v1_header(header, "x")
except TraceError as err:
    print("bad", err.message)
result, _ = flow.fuzz(Cell.from_args(args), seconds=1.0)
print("runs", result.runs)
try:
    flow.probe_target(Cell.from_args(args), "kvspec.conformance.adapter:reference")
except ValueError as err:
    print("refused", err)
""",
    )
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["written"] == "3" and lines["default-unwritten"] == "True"
    assert lines["read"] == "3"
    assert lines["bad"] == '"model.widget" must be an integer, got a string'
    assert lines["runs"] == "0"  # every run refused by the reference engine: never "holds"
    assert "has no setting widget" in lines["refused"]


def test_every_config_field_of_a_cell_reaches_the_config_and_the_trace() -> None:
    """In this tree: each of ``Cell``'s ``Config`` fields set away from its default reaches the
    run's ``Config``, is written in the trace header and read back."""
    away = {"async_scheduling": True, "stale_output": "deliver", "prefix_caching": False}
    away |= {"spec_tokens": 2, "sliding_window": 8, "depth": 3, "discipline": "general"}
    away |= {"preemption": "priority", "policy": "eager-unsafe"}
    cell = Cell(**away)
    config = cell.probe_config()
    back, _ = trace._v1_header(trace.header_for(config, ("e", "1")), "x")
    for name, value in away.items():
        assert getattr(config, name) == value == getattr(back, name), name
    assert "window 8" in verdicts.columns(cell)[3] and "2 draft tokens" in cell.name()


def test_results_are_records_that_answer_for_their_cell() -> None:
    cell = Cell("deferred", loads=True)
    error = verdicts.CellError(cell, "E", "trace")
    assert (error.policy, error.loads, error.discipline) == ("deferred", True, "vllm")
    with pytest.raises(AttributeError):
        error.no_such_field  # noqa: B018
