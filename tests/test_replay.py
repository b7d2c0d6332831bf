"""Traces replayed on a paged KV cache against dense attention: the plan the spec derives, zombie
reads as wrong numbers (the seed's priority victim, a failed external load, the consumer
scenario from the reference engine), holding traces within tolerance, and ``kvspec replay``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from scenarios import SEED, A  # noqa: E402

from kvspec.cli import main  # noqa: E402
from kvspec.conformance.plan import PlanError, replay_plan  # noqa: E402
from kvspec.conformance.trace import read_events, write_events  # noqa: E402
from kvspec.impl.paged.records import Executed, Fill  # noqa: E402
from kvspec.impl.paged.replay import Options, Result, replay  # noqa: E402
from kvspec.judge import Judge  # noqa: E402
from kvspec.reference import Engine, EngineConfig, RandomChoices  # noqa: E402
from kvspec.reference.workload import shared_prefix_workload  # noqa: E402
from kvspec.spec import ACTIONS, Config, apply, initial_state  # noqa: E402
from kvspec.spec.events import Event  # noqa: E402

SEED_CONFIG = Config(
    num_blocks=6, block_size=4, policy="eager-unsafe", preemption="priority", token_budget=12
)


def with_effects(config: Config, decisions: list[Event]) -> tuple[list[Event], list]:
    """The full event list of a run of decisions through the spec, and its bad reads."""
    s = initial_state(config)
    events: list[Event] = []
    for decision in decisions:
        events.append(decision)
        events += apply(s, decision)
    return events, s.bad_reads


def spec_bad_reads(config: Config, events: list[Event]) -> list[tuple[int, int, int]]:
    s = initial_state(config)
    for event in events:
        if event[0] in ACTIONS:
            apply(s, event)
    return s.bad_reads


def run(config: Config, events: list[Event], backend: str, dtype=torch.float32) -> Result:
    plan = replay_plan(config, events)
    return replay(plan, config.num_blocks, config.block_size, Options(backend, dtype))


def holding_trace(requests: int = 24, blocks: int = 24, depth: int = 2) -> tuple[Config, list]:
    """The reference engine (``kvspec simulate``'s loop) under ``deferred``: shared prefixes
    so that requests hit each other's blocks, a small pool so that priority preempts."""
    common = dict(
        num_blocks=blocks,
        block_size=4,
        depth=depth,
        policy="deferred",
        discipline="vllm",
        preemption="priority",
        token_budget=32,
        max_running=8,
    )
    engine = Engine(EngineConfig(**common))
    for rid, prompt, max_tokens, priority in shared_prefix_workload(requests, 3, 16, 4, 4, 0):
        engine.add_request(rid, prompt, max_tokens, priority)
    engine.run()
    return Config(**common), engine.events


def test_plan_fills_allocations_and_reads_steps_before_they_execute() -> None:
    config = Config(num_blocks=6, block_size=4, policy="deferred", token_budget=12)
    decisions = [
        ("arrive", 1, A, 2, 0),
        ("begin", 0),
        ("schedule", 1, 6, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ()),
        ("begin", 1),
        ("schedule", 1, 3, 0),
        ("submit", 1),
        ("execute", 1, ()),
    ]
    events, _ = with_effects(config, decisions)
    plan = list(replay_plan(config, events))
    assert plan[:2] == [Fill(1), Fill(2)]
    first, second = plan[2], plan[-1]
    assert isinstance(first, Executed) and isinstance(second, Executed)
    assert (first.step, first.event_index) == (0, events.index(("execute", 0, ())))
    (work,) = first.work
    assert (work.req, work.start, work.end, work.blocks) == (1, 0, 6, (1, 2))
    assert work.tokens == A[:6] and work.live and not work.load and not work.failed
    (work,) = second.work
    assert (work.start, work.end, work.blocks, work.tokens) == (6, 9, (1, 2, 3), A)
    assert plan[3] == Fill(3)


def test_plan_names_the_illegal_event() -> None:
    config = Config(num_blocks=6, block_size=4)
    events = [("arrive", 1, A, 2, 0), ("begin", 0), ("execute", 0, ())]
    with pytest.raises(PlanError, match="event 2: execute step 0") as caught:
        list(replay_plan(config, events))
    assert caught.value.index == 2


@pytest.mark.parametrize(
    "backend, dtype",
    [("triton", torch.float32), ("triton", torch.bfloat16), ("torch", torch.float16)],
)
def test_seed_zombie_is_a_wrong_number(backend: str, dtype: torch.dtype) -> None:
    events, bad_reads = with_effects(SEED_CONFIG, SEED)
    assert bad_reads == [(3, 3, 4)]  # the spec: step 3, r3 reads block 4
    result = run(SEED_CONFIG, events, backend, dtype)
    m = result.mismatch
    assert m is not None and (m.step, m.req, m.layer) == (3, 3, 0)
    assert m.error != m.error  # NaN: garbage read
    assert [(b.block, b.zombie, b.never_written) for b in m.blocks] == [(4, True, True)]
    assert "block 4 (table index 1, positions 4..7) is a zombie" in str(m)
    assert result.steps == 4 and result.queries == 3 + 9 + 4  # steps 0-2 compared
    assert result.max_error <= (1e-5 if dtype == torch.float32 else 1.5e-2)


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted", "eager-rollback-fifo"])
def test_seed_scenario_holds_under_safe_policies(policy: str) -> None:
    config = Config(
        num_blocks=6, block_size=4, policy=policy, preemption="priority", token_budget=12
    )
    events, bad_reads = with_effects(config, SEED)
    assert bad_reads == []
    result = run(config, events, "triton")
    assert result.mismatch is None and result.steps == 4 and result.max_error < 1e-5


def test_failed_load_leaves_zombies_that_the_retry_reads() -> None:
    """eager-unsafe publishes loaded blocks at schedule time; the load fails; the request's
    retry hits its own published blocks, which hold nothing."""
    config = Config(num_blocks=8, block_size=4, policy="eager-unsafe")
    decisions = [
        ("arrive", 1, A, 2, 0),
        ("begin", 0),
        ("schedule", 1, 0, 2),  # load blocks 0 and 1 from the external store
        ("submit", 0),
        ("execute", 0, (1,)),  # the load fails
        ("commit", 0, ()),
        ("begin", 1),
        ("schedule", 1, 1, 0),  # the retry hits blocks 1 and 2, computes token 8
        ("submit", 1),
        ("execute", 1, ()),
    ]
    events, bad_reads = with_effects(config, decisions)
    assert {block for _, _, block in bad_reads} == {1, 2}
    m = run(config, events, "triton").mismatch
    assert m is not None and (m.step, m.req) == (1, 1)
    assert [(b.block, b.zombie, b.never_written) for b in m.blocks] == [
        (1, True, True),
        (2, True, True),
    ]
    # a load that succeeds writes the right K/V: another request hits and reads them
    loaded = decisions[:4] + [
        ("execute", 0, ()),
        ("commit", 0, ()),
        ("arrive", 2, A[:8] + (5,), 1, 0),
        ("begin", 1),
        ("schedule", 2, 1, 0),  # hits blocks 1 and 2, computes token 8
        ("submit", 1),
        ("execute", 1, ()),
    ]
    events, bad_reads = with_effects(config, loaded)
    assert bad_reads == [] and ("hit", 2, (1, 2)) in events
    result = run(config, events, "triton")
    assert result.mismatch is None and result.queries == 1


def test_consumer_zombie_from_the_reference_engine() -> None:
    """The reference engine under ``general`` (a third-party scheduler): a request hits blocks
    of another that is then withdrawn from the step. Replay finds the spec's bad read."""
    common = dict(
        num_blocks=12,
        block_size=4,
        policy="eager-unsafe",
        discipline="general",
        preemption="priority",
        token_budget=8,
        max_running=4,
    )
    engine = Engine(EngineConfig(**common), choices=RandomChoices(1))
    for rid, prompt, max_tokens, priority in shared_prefix_workload(4, 2, 8, 4, 3, 1):
        engine.add_request(rid, prompt, max_tokens, priority)
    engine.run()
    config = Config(**common)
    bad_reads = spec_bad_reads(config, engine.events)
    assert bad_reads
    m = run(config, engine.events, "triton").mismatch
    assert m is not None
    first_step = bad_reads[0][0]
    expected = {(req, block) for step, req, block in bad_reads if step == first_step}
    assert m.step == first_step and {(m.req, b.block) for b in m.blocks} <= expected
    assert all(b.zombie for b in m.blocks) and m.blocks


def test_fuzzed_counterexample_replays_as_the_spec_reads_it(seed_bug_run, capsys) -> None:  # type: ignore[no-untyped-def]
    """``kvspec fuzz --out`` then ``kvspec replay``. The fuzzer stops at the first broken
    invariant: for eager-unsafe under priority preemption that is NoUnwrittenPublish, and in
    the shrunk run the zombie is evicted and rewritten before anyone reads it. The replay
    agrees with the spec: a wrong number exactly when the spec has a bad read. (The fuzzer
    runs as the command line does, in its own process: ``conftest.seed_bug_run``.)"""
    done, out = seed_bug_run, seed_bug_run.path
    assert done.returncode == 1 and "violated: NoUnwritten" in done.stdout, done.stderr
    config, events = read_events(out)
    code = main(["replay", str(out)])
    text = capsys.readouterr().out
    assert code == (1 if spec_bad_reads(config, events) else 0), text
    executed = sum(1 for e in events if e[0] == "execute")
    assert f"replayed {executed} steps" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_holding_trace_matches_dense_attention(dtype: torch.dtype) -> None:
    config, events = holding_trace()
    judge = Judge.spec(config)
    assert judge.feed_all(events) is None and judge.settle() is None
    assert any(e[0] == "preempt" for e in events)
    assert sum(len(e[2]) for e in events if e[0] == "hit") > 50  # prefix hits are read
    result = run(config, events, "triton", dtype)
    assert result.mismatch is None, result.mismatch
    assert result.steps == sum(1 for e in events if e[0] == "execute")
    assert result.queries > 200
    if dtype == torch.float32:
        assert result.max_error < 1e-5
    else:
        assert result.max_error <= 1.5e-2 * 2  # every element within atol + rtol * |dense|


def test_cli_replay_exit_codes(tmp_path: Path, capsys) -> None:
    holding = tmp_path / "holding.jsonl"
    config, events = holding_trace(requests=40, blocks=32, depth=1)
    write_events(holding, config, events)
    assert main(["replay", str(holding), "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "every step matches" in out and "max error" in out

    failing = tmp_path / "seed.jsonl"
    write_events(failing, SEED_CONFIG, with_effects(SEED_CONFIG, SEED)[0])
    argv = ["replay", str(failing), "--dtype", "bfloat16", "--heads", "9", "--kv-heads", "3"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "MISMATCH at step 3" in out and "r3" in out and "block 4" in out and "zombie" in out

    bad = tmp_path / "bad.jsonl"
    lines = failing.read_text().splitlines()
    bad.write_text("\n".join(lines[:5] + ['["execute", 7, []]'] + lines[5:]) + "\n")
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}:6: execute: step 7 never began" in err
    bad.write_text(lines[0] + "\nnot json\n")
    assert main(["replay", str(bad)]) == 2
    assert f"{bad}:2: not JSON" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["replay", str(failing), "--heads", "3", "--kv-heads", "2"]) == 2
    assert "not a multiple" in capsys.readouterr().err


def test_fuzzed_zombie_read_replays_to_a_mismatch(tmp_path: Path, capsys) -> None:
    """``kvspec fuzz --invariant NoUnwrittenRead --out`` then ``kvspec replay``: the counterexample
    ends in a real read of a never-written block, and the tensors show it."""
    out = tmp_path / "zombie.jsonl"
    argv = ["fuzz", "--policy", "eager-unsafe", "--discipline", "general", "--seed", "1"]
    argv += ["--invariant", "NoUnwrittenRead", "--seconds", "600", "--out", str(out)]
    assert main(argv) == 1
    assert "violated: NoUnwrittenRead" in capsys.readouterr().out
    assert main(["replay", str(out)]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH" in text and "zombie" in text


def test_an_engine_registers_trace_replays(tmp_path: Path, capsys) -> None:
    """An observed trace of an engine that registers on its own (SGLang's shape: publishes after
    the write, a dedup onto the other request's copy) replays: the plan follows the engine's own
    effects through the observed judge, and every attention output matches."""
    from test_engine_registers import BOTH_ADMITTED, DECODE_BOTH, ER, INSERT_BOTH

    from kvspec.conformance.trace import write_trace

    path = tmp_path / "sglang-like.jsonl"
    write_trace(path, ER, BOTH_ADMITTED + INSERT_BOTH + DECODE_BOTH, judging="observed")
    assert main(["replay", str(path), "--backend", "torch", "--layers", "1"]) == 0
    assert "every step matches dense attention" in capsys.readouterr().out
