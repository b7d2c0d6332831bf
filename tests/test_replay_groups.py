"""Hybrid traces (several KV-cache groups: full, sliding window, state) replayed on paged caches
against the dense toy model: the reference engine's holding traces match within tolerance with
the hybrid paths reached; the seed's zombie in a window group, and reads the spec's plan is
planted with (a window block recycled while a step reads it, a state block recycled before the
step that starts from it, a window group read past its window), are wrong numbers that name
their block and group."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from scenarios import SEED  # noqa: E402

from kvspec.cli import main  # noqa: E402
from kvspec.conformance.plan import replay_groups, replay_plan  # noqa: E402
from kvspec.conformance.trace import write_events  # noqa: E402
from kvspec.impl.paged.records import Executed, Fill, GroupLayout, Record, Work  # noqa: E402
from kvspec.impl.paged.replay import Options, Replayer, Result, replay, table  # noqa: E402
from kvspec.judge import Judge  # noqa: E402
from kvspec.reference import Engine, EngineConfig, GroupSpec, RandomChoices  # noqa: E402
from kvspec.reference.workload import shared_prefix_workload  # noqa: E402
from kvspec.spec import Config, apply, initial_state  # noqa: E402
from kvspec.spec.state import Group  # noqa: E402

GROUPS = (("full", 2), ("window", 2, 4), ("state", 4))
"""Group 0 full at the hash block size, a window of 4 tokens, a state group of 4-token blocks."""


def hybrid_trace(groups: tuple[tuple, ...] = GROUPS, requests: int = 10) -> tuple[Config, list]:
    """The reference engine with ``groups`` under ``deferred`` (safe), vLLM's scheduler with
    priority preemption, shared prefixes in a small pool: requests hit each other's blocks in
    every group, and windows null their leading blocks."""
    common = dict(
        num_blocks=40,
        block_size=2,
        depth=2,
        policy="deferred",
        discipline="vllm",
        preemption="priority",
        token_budget=16,
        max_running=6,
    )
    specs = tuple(GroupSpec(*g) for g in groups)
    engine = Engine(EngineConfig(**common, groups=specs), RandomChoices(0))  # type: ignore[arg-type]
    for rid, prompt, max_tokens, priority in shared_prefix_workload(requests, 3, 12, 4, 4, 0):
        engine.add_request(rid, prompt, max_tokens, priority)
    engine.run()
    return Config(**common, groups=tuple(Group(*g) for g in groups)), engine.events  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def hybrid() -> tuple[Config, list, list[Record]]:
    config, events = hybrid_trace()
    judge = Judge.spec(config)
    assert judge.feed_all(events) is None and judge.settle() is None
    return config, events, replay_plan(config, events)


def run_plan(
    config: Config,
    plan: list[Record],
    backend: str = "torch",
    dtype: torch.dtype = torch.float32,
    groups: tuple[GroupLayout, ...] | None = None,
) -> Result:
    layout = replay_groups(config) if groups is None else groups
    options = Options(backend, dtype, num_layers=len(layout))
    return replay(plan, config.num_blocks, config.block_size, options, layout)


def reads(plan: list[Record]) -> list[tuple[int, Work]]:
    """(plan index, work) of every live computing entry."""
    return [
        (i, w)
        for i, r in enumerate(plan)
        if isinstance(r, Executed)
        for w in r.work
        if w.live and not w.load
    ]


def test_hybrid_trace_matches_dense_attention(hybrid) -> None:  # type: ignore[no-untyped-def]
    """Every output of every layer (full, window, state) within float32 tolerance, through the
    Triton kernels (the interpreter without a GPU); the trace reaches every hybrid path: hits in
    each group, window blocks nulled before steps that read the window, steps that start from a
    state block a hit gave them."""
    config, events, plan = hybrid
    hits = {g: 0 for g in range(3)}
    for e in events:
        if e[0] == "hit":
            hits[e[3] if len(e) > 3 else 0] += sum(1 for b in e[2] if b)  # type: ignore[index, union-attr]
    assert min(hits.values()) > 0, hits
    window_nulls = [w for _, w in reads(plan) if 0 in table(w, 1)[: w.start // 2]]
    state_starts = [w for _, w in reads(plan) if w.start > 0 and w.start % 4 == 0]
    assert window_nulls and state_starts
    result = run_plan(config, plan, "triton")
    assert result.mismatch is None, result.mismatch
    assert result.steps == sum(1 for e in events if e[0] == "execute")
    assert result.queries > 100 and result.max_error < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hybrid_trace_holds_in_16_bits(hybrid, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    config, _, plan = hybrid
    result = run_plan(config, plan, "torch", dtype)
    assert result.mismatch is None, result.mismatch
    assert result.max_error <= 1.5e-2 * 2


SEED_WINDOW = Config(
    num_blocks=11,
    block_size=4,
    policy="eager-unsafe",
    preemption="priority",
    token_budget=12,
    groups=(Group("full", 4), Group("window", 4, 5)),
)


def seed_window_events() -> tuple[list, list]:
    """The seed's decisions under ``SEED_WINDOW``, with the spec's effects; its bad reads."""
    s = initial_state(SEED_WINDOW)
    events: list = []
    for decision in SEED:
        events.append(decision)
        events += apply(s, decision)
    return events, s.bad_reads


def test_seed_zombie_in_a_window_group_is_a_wrong_number() -> None:
    """The seed (eager-unsafe, priority) with a window group beside the full one: the spec's
    bad reads are one block per group (r3 in step 3), and the replay names exactly those, both
    zombies never written."""
    config = SEED_WINDOW
    events, bad_reads = seed_window_events()
    assert bad_reads == [(3, 3, 7), (3, 3, 9)]
    result = run_plan(config, replay_plan(config, events), "triton")
    m = result.mismatch
    assert m is not None and (m.step, m.req) == (3, 3)
    assert {(b.block, b.group) for b in m.blocks} == {(7, 0), (9, 1)}, str(m)
    assert all(b.zombie and b.never_written for b in m.blocks)
    assert "group 1's block 9" in str(m)


def test_window_layers_never_read_before_the_window(hybrid) -> None:  # type: ignore[no-untyped-def]
    """The same plan with the window group attended as full attention (planted: the window
    forgotten) reads the nulled blocks before the window (NaN): the first such read is a
    mismatch naming the null block of group 1. So the holding replay above holds because the
    window layers read inside the window only."""
    config, _, plan = hybrid
    layout = replay_groups(config)
    forgetful = (layout[0], GroupLayout("full", layout[1].block_size), layout[2])
    m = run_plan(config, plan, groups=forgetful).mismatch
    assert m is not None and m.layer == 1 and m.error != m.error  # NaN
    assert any(b.block == 0 and b.group == 1 for b in m.blocks), str(m)


def _planted_fill(plan: list[Record], at: int, block: int) -> list[Record]:
    """The plan with ``Fill(block)`` just before record ``at``: the block freed and reallocated
    (fresh garbage) while the step at ``at`` still reads it."""
    return [*plan[:at], Fill(block), *plan[at:]]


def test_a_recycled_window_block_is_a_wrong_number(hybrid) -> None:  # type: ignore[no-untyped-def]
    """``NoReadOfRecycled``'s consequence: a block inside a reader's window, recycled before
    its step runs (planted in the plan: the reference engine's early free is refused by the
    spec, so it never reaches a plan), is a mismatch naming that block of group 1, a zombie."""
    config, _, plan = hybrid
    at, work, block = next(
        (i, w, table(w, 1)[j])
        for i, w in reads(plan)
        for j in range(len(table(w, 1)))
        if table(w, 1)[j] and j * 2 < w.start and j * 2 + 1 > w.start - 4
    )
    result = run_plan(config, _planted_fill(plan, at, block))
    m = result.mismatch
    assert m is not None and m.req == work.req and m.step == plan[at].step  # type: ignore[union-attr]
    assert [(b.block, b.group, b.zombie) for b in m.blocks] == [(block, 1, True)], str(m)


def test_a_recycled_state_block_is_a_wrong_number(hybrid) -> None:  # type: ignore[no-untyped-def]
    """The state a step starts from, recycled before the step runs (planted in the plan), is a
    mismatch at the state layer naming the state block, never written since."""
    config, _, plan = hybrid
    at, work = next((i, w) for i, w in reads(plan) if w.start > 0)
    block = table(work, 2)[-(-work.start // 4) - 1]
    m = run_plan(config, _planted_fill(plan, at, block)).mismatch
    assert m is not None and m.req == work.req and m.layer == 2
    (bad,) = m.blocks
    assert (bad.block, bad.group, bad.kind, bad.never_written) == (block, 2, "state", True)
    assert f"state block {block}" in str(m)


def test_a_state_of_another_prefix_is_a_wrong_number(hybrid) -> None:  # type: ignore[no-untyped-def]
    """A step pointed at a state block holding another request's state (planted: its table's
    block swapped for one another request's step wrote just before) is named a zombie that
    holds another prefix's state."""
    config, _, plan = hybrid
    for at, work in reads(plan):
        if work.start == 0:
            continue
        step = plan[at]
        assert isinstance(step, Executed)
        earlier = [
            (r, w)
            for r in plan[:at]
            if isinstance(r, Executed)
            for w in r.work
            if w.req != work.req and not w.failed
        ]
        if not earlier:
            continue
        other = table(earlier[-1][1], 2)[-1]
        index = -(-work.start // 4) - 1
        if other == table(work, 2)[index]:
            continue
        groups = list(work.groups)
        swapped = list(groups[1])
        swapped[index] = other
        groups[1] = tuple(swapped)
        planted_work = replace(work, groups=tuple(groups))
        planted = replace(step, work=tuple(planted_work if w is work else w for w in step.work))
        m = run_plan(config, [*plan[:at], planted, *plan[at + 1 :]]).mismatch
        if m is None:  # the other state block was recycled since: garbage read elsewhere
            continue
        assert m.req == work.req and m.layer == 2, str(m)
        (bad,) = m.blocks
        assert (bad.block, bad.kind, bad.zombie) == (other, "state", True)
        return
    raise AssertionError("no step to plant a swapped state in")


def test_cli_replays_a_hybrid_trace(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``kvspec replay`` reads the groups from the trace's header: a holding hybrid trace exits
    0 (one layer a group at least, whatever ``--layers``), the seed with a window group exits 1
    naming group 1's zombie."""
    config, events = hybrid_trace(requests=4)
    holding = tmp_path / "hybrid.jsonl"
    write_events(holding, config, events)
    assert main(["replay", str(holding), "--backend", "torch", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "groups full, window 4, state (layer i in group i % 3)" in out, out
    assert "3 layers" in out and "every step matches" in out
    seed = tmp_path / "seed.jsonl"
    write_events(seed, SEED_WINDOW, seed_window_events()[0])
    assert main(["replay", str(seed), "--backend", "torch"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH at step 3" in out and "group 1's block 9" in out, out


def test_the_replay_runs_on_cuda_when_there_is_one() -> None:
    """The caches, the state blocks and the dense model live on CUDA when it is available (the
    GPU check runs these tests there), else on the CPU under the Triton interpreter."""
    want = "cuda" if torch.cuda.is_available() else "cpu"
    layout = replay_groups(SEED_WINDOW) + (GroupLayout("state", 8),)
    replayer = Replayer(12, 4, Options(num_layers=3), layout)
    assert replayer.device.type == want and replayer.model.device.type == want
    assert replayer.cache.k[0].device.type == want
    assert replayer.states[2][0].device.type == want
