"""The rough edges a new user hit (issue #34), each kept by a test: run as a user runs kvspec
(its own process), with the fake engines of ``fake_engines.py`` as ``--target``."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import orjson
import pytest
from edges import KVSPEC, one_line, run, seed_counterexample

from kvspec.cli import build_parser
from kvspec.conformance.trace import write_trace

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def zombie(tmp_path: Path) -> Path:
    config, events = seed_counterexample()
    path = tmp_path / "zombie.jsonl"
    write_trace(path, config, events)
    return path


def fuzz(*argv: str, seconds: str = "20") -> subprocess.CompletedProcess[str]:
    """``kvspec fuzz`` from this folder (so that ``--target fake_engines:...`` imports)."""
    return run(["fuzz", "--seconds", seconds, *argv], cwd=TESTS)


def test_an_observed_engine_with_format_v0_is_refused_before_fuzzing(tmp_path: Path) -> None:
    out = tmp_path / "f.jsonl"
    done = fuzz("--policy", "eager-unsafe", "--preemption", "priority", "--target",
                "fake_engines:observed", "--out", str(out), seconds="600")  # fmt: skip
    assert done.returncode == 2 and one_line(done.stderr), done.stdout + done.stderr
    assert "--format v1" in done.stderr and "counterexample" not in done.stdout
    assert not out.exists()


def test_an_observed_engine_with_format_v1_writes_its_finding(tmp_path: Path) -> None:
    out = tmp_path / "f.jsonl"
    done = fuzz("--policy", "eager-unsafe", "--discipline", "general", "--target",
                "fake_engines:observed", "--out", str(out), "--format", "v1")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert orjson.loads(out.read_bytes().splitlines()[0])["judging"] == "observed"


@pytest.mark.parametrize("factory", ["exits", "exits_later"])
def test_a_factory_that_exits_is_bad_input_not_holds(factory: str) -> None:
    done = fuzz("--policy", "deferred", "--target", f"fake_engines:{factory}", seconds="5")
    assert done.returncode == 2 and one_line(done.stderr), done.stdout + done.stderr
    assert "SystemExit" in done.stderr


@pytest.mark.parametrize("how", ["-", "/dev/stdin", "fifo"])
def test_check_reads_a_pipe(zombie: Path, tmp_path: Path, how: str) -> None:
    data = zombie.read_bytes()
    if how == "fifo":
        fifo = tmp_path / "t.fifo"
        os.mkfifo(fifo)
        process = subprocess.Popen([*KVSPEC, "check", str(fifo)], stdout=subprocess.PIPE, text=True)
        fifo.write_bytes(data)
        out = process.communicate(timeout=120)[0]
        code, name = process.returncode, str(fifo)
    else:
        done = subprocess.run([*KVSPEC, "check", how], input=data, capture_output=True, timeout=120)
        out, code = done.stdout.decode(), done.returncode
        name = "<stdin>" if how == "-" else how
    assert code == 1, out
    assert f"{name}:" in out and "NoUnwrittenPublish" in out


def test_check_names_a_bad_stream_at_its_line() -> None:
    done = subprocess.run(
        [*KVSPEC, "check", "-"], input=b"{}\n", capture_output=True, timeout=120, text=False
    )
    stderr = done.stderr.decode()
    assert done.returncode == 2 and one_line(stderr) and stderr.startswith("<stdin>:1:"), stderr


def test_check_a_folder_is_one_line(tmp_path: Path) -> None:
    done = run(["check", str(tmp_path)])
    assert done.returncode == 2 and one_line(done.stderr) and str(tmp_path) in done.stderr


@pytest.mark.parametrize("option", ["--html", "--witness"])
def test_an_output_that_would_overwrite_its_input_is_refused(
    zombie: Path, tmp_path: Path, option: str
) -> None:
    before = zombie.read_bytes()
    other = tmp_path / "sub" / ".." / zombie.name  # the same file under another spelling
    (tmp_path / "sub").mkdir()
    done = run(["check", str(zombie), option, str(other)])
    assert done.returncode == 2 and one_line(done.stderr) and "overwrite" in done.stderr
    assert zombie.read_bytes() == before


def test_db_that_cannot_be_a_folder_is_refused_before_fuzzing(tmp_path: Path) -> None:
    afile = tmp_path / "f"
    afile.write_text("")
    for db in (str(afile), str(afile / "db")):
        started = time.monotonic()
        done = fuzz("--policy", "deferred", "--db", db, seconds="600")
        assert done.returncode == 2 and one_line(done.stderr) and "--db" in done.stderr
        assert time.monotonic() - started < 60  # not after 600 s of fuzzing


def test_db_saves_a_found_example(tmp_path: Path) -> None:
    db = tmp_path / "db"
    done = fuzz("--policy", "eager-unsafe", "--discipline", "general", "--db", str(db))
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(p.is_file() for p in db.rglob("*")), "the counterexample was not saved"


def test_a_demo_budget_too_small_for_any_run_is_undecided() -> None:
    done = run(["demo", "--seconds", "0.001"])
    assert done.returncode == 3, done.stdout + done.stderr
    assert "undecided" in done.stdout


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:", "tcp://no-such-host.invalid:5557"]
)
def test_watch_with_an_invalid_endpoint_is_bad_input(endpoint: str) -> None:
    done = run(["watch", endpoint, "--seconds", "0.5"])
    assert done.returncode == 2 and one_line(done.stderr) and endpoint in done.stderr


@pytest.mark.parametrize("fmt", ["v1", "v0"])
def test_a_header_depth_beyond_what_fuzz_takes_is_refused(zombie: Path, fmt: str) -> None:
    lines = zombie.read_bytes().splitlines()
    header = orjson.loads(lines[0])
    if fmt == "v0":
        header = {"format": "kvspec-events", "version": 0, "config": dict(header["model"])}
        header["config"].update(num_blocks=6, block_size=4)
        lines = lines[:1]
    header["model" if fmt == "v1" else "config"]["depth"] = 10**9
    zombie.write_bytes(b"\n".join([orjson.dumps(header), *lines[1:]]) + b"\n")
    done = run(["check", str(zombie)])
    assert done.returncode == 2 and one_line(done.stderr), done.stderr
    assert "depth" in done.stderr and "64" in done.stderr


def test_no_shrink_help_does_not_claim_a_default() -> None:
    fuzz_parser = build_parser()._subparsers._group_actions[0].choices["fuzz"]  # type: ignore[union-attr]
    text = fuzz_parser.format_help()
    start = text.index("  --no-shrink ")
    assert "default: True" not in text[start : start + 200]


def test_a_huge_line_is_priced_against_the_memory_budget(tmp_path: Path, zombie: Path) -> None:
    header = zombie.read_bytes().splitlines()[0]
    tokens = b",".join([b"1"] * 2_000_000)
    line = b'{"ev":"arrive","req":0,"tokens":[' + tokens + b'],"max_tokens":1,"priority":0}'
    path = tmp_path / "big.jsonl"
    path.write_bytes(header + b"\n" + line + b"\n")
    for engine in ("fast", "spec"):
        done = run(["check", str(path), "--max-memory", "64M", "--engine", engine])
        assert done.returncode == 2 and one_line(done.stderr), done.stderr
        assert done.stderr.startswith(f"{path}:2:") and "--max-memory" in done.stderr
    assert run(["check", str(path), "--max-memory", "512M"]).returncode == 0


def test_demo_shows_the_synchronous_cells_and_full_shows_all() -> None:
    quick = run(["demo", "--seconds", "0.001"])
    full = run(["demo", "--seconds", "0.001", "--full"])
    assert "20 cells in" in quick.stdout and "kvspec demo --full" in quick.stdout, quick.stdout
    assert "45 cells in" in full.stdout and "async, deliver" in full.stdout, full.stdout
    assert "async" not in quick.stdout.split("kvspec verdicts")[1].split("cells in")[0]
