"""``thirdparty/vllm_suite.py run --also DIR``: the table of vLLM's whole ``tests/v1/core`` from
the CI subset's run and a run of the other files (``docs/vllm-suite.md``). On a suite folder of
two tiny test files (no vLLM test needed), in the first vLLM environment built (the script is
standard library only; its pytest and vLLM are the environment's). ``table``: an earlier run's
table joined, nothing run (in this process, on hand-written run folders)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from vllm_venvs import RELEASES

ROOT = Path(__file__).resolve().parent.parent
BUILT = [(v, ROOT / f) for v, f in RELEASES.items() if (ROOT / f / ".stamp").exists()]

needs_vllm = pytest.mark.skipif(not BUILT, reason="no vLLM environment: run `make thirdparty`")


def _suite(venv: Path, suite: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    command = [str(venv / "bin" / "python"), "thirdparty/vllm_suite.py", "run", "--suite"]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run(
        [*command, str(suite), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


@needs_vllm
@pytest.mark.e2e
def test_an_earlier_run_joins_the_table_once(tmp_path: Path) -> None:
    version, venv = BUILT[0]
    suite = tmp_path / "suite"
    core = suite / "tests" / "v1" / "core"
    core.mkdir(parents=True)
    (suite / "VERSION").write_text(version + "\n")
    (core / "test_a.py").write_text("def test_passes():\n    pass\n")
    (core / "test_b.py").write_text("def test_fails():\n    assert False\n")
    first = _suite(
        venv, suite, "--parallel", "--out", str(tmp_path / "a"), "tests/v1/core/test_a.py"
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "items: 1; passing without the plugin: 1" in first.stdout, first.stdout
    joined = _suite(
        venv, suite, "--parallel", "--out", str(tmp_path / "b"), "--also", str(tmp_path / "a"),
        "tests/v1/core/test_b.py",
    )  # fmt: skip
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert "items: 2; passing without the plugin: 1" in joined.stdout, joined.stdout
    assert "outcomes that differ with the plugin (violations aside): 0" in joined.stdout
    twice = _suite(
        venv, suite, "--out", str(tmp_path / "c"), "--also", str(tmp_path / "a"),
        "tests/v1/core/test_a.py",
    )  # fmt: skip
    assert twice.returncode == 2, twice.stdout + twice.stderr
    assert "is in this run too" in twice.stderr and "Traceback" not in twice.stderr


def _suite_module() -> object:
    spec = importlib.util.spec_from_file_location("vllm_suite", ROOT / "thirdparty/vllm_suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_folder(folder: Path, name: str, failed: bool, outcome: str, features: list[str]) -> None:
    folder.mkdir()
    case = f'<testcase file="tests/v1/core/{name}.py" name="test_it">'
    case += "<failure/>" if failed else ""
    xml = f"<testsuites><testsuite>{case}</testcase></testsuite></testsuites>"
    for junit in ("junit-bare.xml", "junit-plugin.xml"):
        (folder / junit).write_text(xml)
    entry = {"outcome": outcome, "features": features}
    report = {"tests": {f"tests/v1/core/{name}.py::test_it": entry}}
    (folder / "kvspec-report.json").write_text(json.dumps(report))


def test_table_joins_earlier_runs_without_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = _suite_module()
    _run_folder(tmp_path / "ci", "test_a", False, "judged", [])
    _run_folder(tmp_path / "rest", "test_b", True, "construction", ["HiSparse"])
    assert suite.retable(tmp_path / "ci", [tmp_path / "rest"]) == 0  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert "items: 2; passing without the plugin: 1" in out, out
    assert "judged and holding: 1 of 2 items that build one (50%)" in out, out
    assert "HiSparse: 1 (1)" in out, out
    with pytest.raises(SystemExit) as twice:
        suite.retable(tmp_path / "ci", [tmp_path / "ci"])  # type: ignore[attr-defined]
    assert twice.value.code == 2


def test_the_pass_without_the_plugin_is_the_union_of_earlier_runs(tmp_path: Path) -> None:
    """``--bare-from`` repeated: a whole-suite plugin pass compared with the earlier passes of its
    parts (a folder, or a JUnit file named directly); a test two of them saw differently is bad
    input, not a silent pick."""
    suite = _suite_module()
    _run_folder(tmp_path / "ci", "test_a", False, "judged", [])
    _run_folder(tmp_path / "rest", "test_b", True, "judged", [])
    junits = [
        suite._bare_junit(tmp_path / "ci"),
        suite._bare_junit(tmp_path / "rest" / "junit-bare.xml"),
    ]  # type: ignore[attr-defined]
    union = suite._union_of_outcomes(junits)  # type: ignore[attr-defined]
    assert union == {
        "tests/v1/core/test_a.py::test_it": "passed",
        "tests/v1/core/test_b.py::test_it": "failed",
    }
    assert suite._union_of_outcomes([*junits, junits[0]]) == union  # type: ignore[attr-defined]
    _run_folder(tmp_path / "again", "test_a", True, "judged", [])
    with pytest.raises(SystemExit) as differs:
        suite._union_of_outcomes([*junits, tmp_path / "again" / "junit-bare.xml"])  # type: ignore[attr-defined]
    assert differs.value.code == 2
    with pytest.raises(SystemExit) as missing:
        suite._bare_junit(tmp_path / "nowhere")  # type: ignore[attr-defined]
    assert missing.value.code == 2
    seen = {**union, "tests/v1/core/test_c.py::test_it[x-1]": "skipped", "t.py::e": "error"}
    suite._write_outcomes(tmp_path / "kept.xml", seen)  # type: ignore[attr-defined]
    assert suite.outcomes(tmp_path / "kept.xml") == seen  # type: ignore[attr-defined]
    suite._refuse_overlap([tmp_path / "ci"], ["tests/v1/core/test_b.py"])  # type: ignore[attr-defined]
    for overlapping in (["tests/v1/core/test_a.py"], ["tests/v1/core/"], ["tests/v1"]):
        with pytest.raises(SystemExit) as twice:  # refused before any test runs
            suite._refuse_overlap([tmp_path / "ci"], overlapping)  # type: ignore[attr-defined]
        assert twice.value.code == 2


def test_a_recorded_pass_without_the_plugin_serves_only_its_release_tests_and_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``record`` keeps a run's pass without the plugin; ``recorded`` hands it back only for the
    same release, the same tests and the same pinned packages (else ``None`` and why: the pass
    is then run, never compared with a record of something else)."""
    suite = _suite_module()
    pins = tmp_path / "thirdparty"
    pins.mkdir()
    for name in suite.RECORD_INPUTS:  # type: ignore[attr-defined]
        (pins / name).write_text(f"{name}==1\n")
    monkeypatch.setattr(suite, "THIRDPARTY", pins)
    monkeypatch.setattr(suite, "RECORDS", pins / "vllm-suite-bare")
    _run_folder(tmp_path / "ci", "test_a", True, "judged", [])
    paths = ["tests/v1/core/test_a.py"]
    with pytest.raises(SystemExit) as other_tests:
        suite.record(tmp_path / "ci", "0.33.0", ["tests/v1/core/test_b.py"])  # type: ignore[attr-defined]
    assert other_tests.value.code == 2
    assert suite.record(tmp_path / "ci", "0.33.0", paths) == 0  # type: ignore[attr-defined]
    known, why = suite.recorded("0.33.0", paths)  # type: ignore[attr-defined]
    assert known == {"tests/v1/core/test_a.py::test_it": "failed"}, why
    assert suite.recorded("0.34.0", paths) == (
        None,
        f"no record of vLLM 0.34.0 ({pins / 'vllm-suite-bare' / '0.34.0.json'})",
    )  # type: ignore[attr-defined]
    assert suite.recorded("0.33.0", [*paths, "tests/v1/core/test_b.py"])[0] is None  # type: ignore[attr-defined]
    (pins / suite.RECORD_INPUTS[0]).write_text("vllm==2\n")  # type: ignore[attr-defined]
    known, why = suite.recorded("0.33.0", paths)  # type: ignore[attr-defined]
    assert known is None and "other pins" in why
