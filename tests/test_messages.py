"""Messages that said something other than the truth (issue #14), each now said as it is; the
engine's own log lines kept out of kvspec's output; nothing written into the current folder."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from edges import one_line, run, seed_counterexample

from kvspec.conformance.trace import GUARANTEES, TraceError, parse_header, parse_line
from kvspec.judge import Judge

V1_HEADER = {
    "format": "kvspec-trace",
    "version": 1,
    "engine": {"name": "e", "version": "1"},
    "num_blocks": 8,
    "block_size": 4,
    "null_block": 0,
    "guarantees": {name: True for name in GUARANTEES},
    "model": {},
}
V0_HEADER = {"format": "kvspec-events", "version": 0, "config": {"num_blocks": 8, "block_size": 4}}


def reason(raw: bytes) -> str:
    with pytest.raises(ValueError) as err:
        parse_line(raw, 8)
    return str(err.value)


@pytest.mark.parametrize(
    "number, words",
    [
        (b"1000000000000000000000000000000", "beyond the 64-bit integers"),
        (b"18446744073709551616", "beyond the 64-bit integers"),
        (b"1.5", "a number with a fraction"),
        (b"1.0", "a decimal point or an exponent"),
        (b"1e3", "a decimal point or an exponent"),
    ],
)
def test_numbers_are_called_what_they_are(number: bytes, words: str) -> None:
    text = reason(b'{"ev":"begin","step":' + number + b"}")
    assert words in text and (words == "a number with a fraction" or "fraction" not in text)


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_is_not_called_a_truncated_line(constant: bytes) -> None:
    text = reason(b'{"ev":"begin","step":' + constant + b"}")
    assert f"{constant.decode()} is not a JSON number" in text and "truncated" not in text
    with pytest.raises(TraceError, match="NaN is not a JSON number"):
        parse_header(orjson.dumps(V1_HEADER).replace(b"8", b"NaN", 1), "t")


def test_a_truncated_line_is_still_called_one() -> None:
    assert "truncated line?" in reason(b'{"ev":"begin","st')


def test_kvspecs_own_older_format_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"a kvspec event file \(format v0\), not a v1 trace"):
        parse_header(orjson.dumps(V0_HEADER), "t")
    path = tmp_path / "t.jsonl"
    path.write_bytes(orjson.dumps({"format": "kvspec-events", "version": 0}) + b"\n")
    done = run(["check", str(path)])
    assert done.returncode == 2 and one_line(done.stderr)
    assert '"config" must be an object, got nothing' in done.stderr
    assert "not a kvspec trace" not in done.stderr
    path.write_bytes(orjson.dumps({"format": "other"}) + b"\n")
    done = run(["check", str(path)])
    assert "not a kvspec trace (header \"format\" is 'other'; kvspec reads" in done.stderr


def test_an_extra_effect_is_not_said_to_be_expected_as_none() -> None:
    config, events = seed_counterexample()
    judge = Judge.spec(config)
    judge.feed_all(events[:2])
    finding = judge.feed(("free", 3))
    assert finding is not None and finding.invariant == "Disagreement"
    assert "None" not in finding.message and "computes no further effect" in finding.message


@pytest.mark.parametrize(
    "config, words",
    [
        ({"num_blocks": 8, "block_size": 4, "colour": 1}, "unknown \"config\" field 'colour'"),
        (
            {"num_blocks": "8", "block_size": 4},
            '"config.num_blocks" must be an integer, got a string',
        ),
        ({"num_blocks": 8}, '"config" needs "block_size"'),
        ({"num_blocks": 8, "block_size": 4, "stop_token": 1.5}, "an integer or null"),
        ({"num_blocks": 8, "block_size": 4, "depth": 0}, "depth must be >= 1"),
        ({"num_blocks": 8, "block_size": 4, "policy": "engine-registers"}, "only a v1 trace"),
    ],
)
def test_v0_headers_are_checked_field_by_field(tmp_path: Path, config: dict, words: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(orjson.dumps(dict(V0_HEADER, config=config)) + b'\n["begin",0]\n')
    done = run(["check", str(path)])
    assert done.returncode == 2 and one_line(done.stderr), done.stderr
    assert words in done.stderr
    for internal in ("__init__", "Config.", "positional argument", "not supported between"):
        assert internal not in done.stderr


@pytest.mark.parametrize(
    "line, words",
    [
        (b'["begin"]', "begin: 1 values after the kind (step), got 0"),
        (b'["begin",0,1]', "got 2"),
        (b'["free",99]', "out of range"),
        (b'["arrive",0,[],1,0]', "must not be empty"),
        (b'{"ev":"begin","step":0}', "a JSON array starting with its kind"),
    ],
)
def test_v0_events_are_checked_as_v1_lines_are(tmp_path: Path, line: bytes, words: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(orjson.dumps(V0_HEADER) + b"\n" + line + b"\n")
    done = run(["check", str(path)])
    assert done.returncode == 2 and one_line(done.stderr) and words in done.stderr, done.stderr


ADAPTER = """
import logging, warnings
from kvspec.conformance.adapter import reference

def factory(config, choices):
    logging.getLogger("someengine").warning("ENGINE-LOG-LINE")
    warnings.warn("ENGINE-WARNING")
    return reference(config, choices)
"""


def test_engine_logs_are_silenced_unless_asked_and_targets_resolve_from_cwd(tmp_path: Path) -> None:
    (tmp_path / "myadapter.py").write_text(ADAPTER)
    argv = ["fuzz", "--policy", "deferred", "--seconds", "2", "--target", "myadapter:factory"]
    env = {"KVSPEC_CACHE_DIR": str(tmp_path / "cache")}
    quiet = run(argv, cwd=tmp_path, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert "ENGINE-" not in quiet.stdout + quiet.stderr
    loud = run(argv + ["--engine-log"], cwd=tmp_path, env=env)
    assert loud.returncode == 0 and "ENGINE-LOG-LINE" in loud.stderr
    assert "ENGINE-WARNING" in loud.stderr


def test_fuzz_writes_nothing_into_the_current_folder(tmp_path: Path) -> None:
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    argv = ["fuzz", "--policy", "eager-unsafe", "--discipline", "general", "--seconds", "20"]
    done = run(argv, cwd=work, env={"KVSPEC_CACHE_DIR": str(cache)})
    assert done.returncode == 1, done.stderr
    assert list(work.iterdir()) == []
    assert (cache / "hypothesis").is_dir()
    db = tmp_path / "db"
    done = run(argv + ["--db", str(db)], cwd=work, env={"KVSPEC_CACHE_DIR": str(cache)})
    assert done.returncode == 1 and any(p.is_file() for p in db.rglob("*"))
