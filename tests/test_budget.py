"""The memory budget (conformance/budget.py): claims priced before anything is allocated, in both
formats, both readers and every command that sizes something; the prices hold as upper bounds."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import orjson
import pytest
from edges import one_line, run, seed_counterexample

from kvspec.conformance import budget
from kvspec.conformance.trace import read_events, write_events, write_trace
from kvspec.judge import Judge
from kvspec.judge.fastbuild import fast_judge
from kvspec.spec import Config


def claim(path: Path, fmt: str, num_blocks: int) -> Path:
    """The seed counterexample (13+ events) under a header claiming ``num_blocks``."""
    config, events = seed_counterexample()
    big = Config(num_blocks=num_blocks, block_size=config.block_size, policy=config.policy,
                 preemption=config.preemption, token_budget=config.token_budget)  # fmt: skip
    (write_trace if fmt == "v1" else write_events)(path, big, events)
    return path


@pytest.mark.parametrize("fmt", ["v0", "v1"])
@pytest.mark.parametrize("engine", ["fast", "spec"])
def test_a_header_claiming_more_than_the_budget_is_refused_at_line_1(
    tmp_path: Path, fmt: str, engine: str
) -> None:
    path = claim(tmp_path / "t.jsonl", fmt, 1 << 24)  # the v1 cap itself: ~31 GB to judge
    done = run(["check", str(path), "--engine", engine, "--max-memory", "1G"])
    assert done.returncode == 2 and one_line(done.stderr), done.stderr
    assert done.stderr.startswith(f"{path}:1: ")
    assert "judging 16,777,216 blocks would take about" in done.stderr
    assert "--max-memory" in done.stderr
    small = claim(tmp_path / "s.jsonl", fmt, 1 << 16)  # ~120 MB priced, ~80 MB used
    assert run(["check", str(small), "--engine", engine, "--max-memory", "64M"]).returncode == 2
    assert run(["check", str(small), "--engine", engine, "--max-memory", "1G"]).returncode == 1


@pytest.mark.parametrize("fmt", ["v0", "v1"])
def test_replay_prices_the_header_before_reading_on(tmp_path: Path, fmt: str) -> None:
    path = claim(tmp_path / "t.jsonl", fmt, 1 << 23)
    done = run(["replay", str(path), "--max-memory", "1G"])
    assert done.returncode == 2 and one_line(done.stderr) and ":1: " in done.stderr


def test_v0_files_past_the_block_cap_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    header = {
        "format": "kvspec-events",
        "version": 0,
        "config": {"num_blocks": 10**12, "block_size": 4},
    }
    path.write_bytes(orjson.dumps(header) + b'\n["begin",0]\n')
    done = run(["check", str(path)])
    assert done.returncode == 2 and one_line(done.stderr) and "16777216" in done.stderr


def test_generate_prices_the_weights_before_loading(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (8 << 20))
    done = run(["generate", "--model", str(model), "--prompt", "x", "--max-memory", "32M"])
    assert done.returncode == 2 and one_line(done.stderr) and "would take about" in done.stderr


def test_the_judges_cost_no_more_per_block_than_priced() -> None:
    n = 20_000

    def fast(config: Config) -> Judge:
        return fast_judge(config)[0]  # type: ignore[no-any-return]

    for make, price in ((Judge.stream, budget.SPEC_JUDGE_PER_BLOCK), (fast, budget.FAST_JUDGE_PER_BLOCK)):  # fmt: skip
        tracemalloc.start()
        judge = make(Config(n, 16))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del judge
        assert peak <= price * n, (make, peak / n)


def test_reading_a_file_whole_costs_no_more_than_priced(tmp_path: Path) -> None:
    from kvspec.cli import main

    out = tmp_path / "e.jsonl"
    assert main(["simulate", "--policy", "deferred", "--requests", "60", "--out", str(out)]) == 0
    tracemalloc.start()
    read_events(out)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= budget.READ_WHOLE_PER_BYTE * out.stat().st_size


@pytest.mark.parametrize("need", [1, 1000, 5 << 20, 3 << 30, 7 << 40])
def test_the_suggested_budget_parses_back_and_covers_the_need(need: int) -> None:
    assert budget.parse_size(budget.suggest(need)) >= need


@pytest.mark.parametrize("text", ["", "G", "-1G", "0", "1e3G", "4X", "nan", "1Y"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        budget.parse_size(text)


def test_max_memory_is_validated_by_the_parser() -> None:
    done = run(["check", "x", "--max-memory", "lots"])
    assert done.returncode == 2 and one_line(done.stderr) and "--max-memory" in done.stderr


def test_the_ceiling_turns_an_unforeseen_allocation_into_memory_error() -> None:
    """Under ``ceiling()`` a calloc far beyond the budget fails at once (without it, Linux grants
    it lazily and the process grows until the kernel kills something)."""
    code = (
        "from kvspec.conformance import budget\n"
        "budget.set_limit(256 << 20)\n"
        "with budget.ceiling():\n"
        "    try:\n"
        "        bytes(16 << 30)\n"
        "    except MemoryError:\n"
        "        print('refused')\n"
        "bytes(16 << 30)\n"  # the limit is lifted again on exit (calloc: no page touched)
        "print('granted')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["refused", "granted"], done.stderr
