"""The flow, in code: a workload drives an engine, the engine emits events, the spec judges them,
and the same events replay on real tensors. One function per arrow; each ``kvspec`` command is one
call here (``cli.py`` parses the arguments and prints the result).

=============================  ==============================================================
arrow                          where it lives
=============================  ==============================================================
workload -> engine             ``conformance/fuzz.py`` (Hypothesis drives an adapter),
                               ``reference/workload.py`` (a fixed shared-prefix workload)
engine -> events               the engine's adapter (``conformance/adapter.py``,
                               ``conformance/adapters/``); on disk ``conformance/trace.py``
events -> verdict              ``conformance/judge/`` (the spec, or its fast twin), reported by
                               ``conformance/report.py`` and ``conformance/html.py``
native KV events -> verdict    ``spec/stream.py`` (what a router may be told),
                               ``conformance/kvevents/`` (captures, live ZMQ, while fuzzing)
events -> tensors              ``conformance/plan.py`` (the spec's plan), ``impl/paged/replay.py``
=============================  ==============================================================

Each function imports what it uses when it is called, so that a command loads only its own arrow
(``kvspec check`` no torch, ``kvspec fuzz`` no z3).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvspec.spec import Config

if TYPE_CHECKING:
    from hypothesis.database import ExampleDatabase

    from kvspec.conformance.adapter import Factory
    from kvspec.conformance.fuzz import CellResult
    from kvspec.conformance.report import Report
    from kvspec.conformance.verdicts import CellError
    from kvspec.impl.paged.replay import Options, Result

Event = tuple[object, ...]


@dataclass(frozen=True)
class Cell:
    """What is fuzzed: a registration policy, a scheduling discipline and preemption, the steps in
    flight (None: drawn 1 to 3, or 2 to 3 when steps overlap), whether external KV loads happen
    (some failing), async scheduling (decodes on placeholder tokens), what becomes of a
    preempted request's output still in flight (``docs/async.md``), whether the pool caches
    prefixes at all (``Config.prefix_caching``), the draft tokens per decode (``spec_tokens``,
    speculative decoding) and a sliding window (``sliding_window``)."""

    policy: str
    discipline: str = "vllm"
    preemption: str = "fcfs"
    depth: int | None = None
    loads: bool = False
    async_scheduling: bool = False
    stale_output: str = "drop"
    prefix_caching: bool = True
    spec_tokens: int = 0
    sliding_window: int | None = None

    @property
    def overlaps(self) -> bool:
        """Whether steps in flight differ from synchronous ones (needs a depth of 2 or more)."""
        return self.async_scheduling or self.stale_output == "deliver"


def fuzz(
    cell: Cell,
    seconds: float,
    seed: int = 0,
    invariants: Collection[str] | None = None,
    target: str | None = None,
    database: ExampleDatabase | None = None,
    shrink: bool = True,
    check_protocol: bool = False,
    bounded: bool = False,
) -> tuple[CellResult, str]:
    """workload -> engine -> events -> verdict: lockstep-fuzz an engine (the reference engine, or
    ``target``, an adapter factory ``module:factory``) against the spec for ``seconds``. The
    result (``fuzz.CellResult``) and how the engine's traces are judged (strict or observed).
    ``database``: Hypothesis's example database; ``shrink=False`` reports the first
    counterexample as found; ``bounded``: ``seconds`` bounds shrinking too and a hung engine
    call is a finding (``fuzz.run_cell``). A ``target``'s adapter is checked against the
    protocol first (``probe_target``: its mistakes are bad input, ``ProtocolError``, never a
    finding); ``check_protocol``: also every call of every run."""
    from kvspec.conformance.fuzz import run_cell
    from kvspec.conformance.protocol import checking

    factory, judging = probe_target(cell, target, seconds)
    if check_protocol:
        factory = checking(factory)
    result = run_cell(
        cell.policy,
        cell.discipline,
        cell.preemption,
        cell.depth,
        cell.loads,
        seconds,
        seed,
        invariants=invariants,
        factory=factory,
        async_scheduling=cell.async_scheduling,
        stale_output=cell.stale_output,
        prefix_caching=cell.prefix_caching,
        database=database,
        shrink=shrink,
        bounded=bounded,
        spec_tokens=cell.spec_tokens,
        sliding_window=cell.sliding_window,
    )
    return result, judging


PROTOCOL_CHECK_SECONDS = 10.0
"""The most a ``--target``'s protocol check before fuzzing may take (bounded further by the
budget): an engine call that does not return is left to the fuzzing's watchdog, which reports it
with the engine's stack."""


def probe_target(
    cell: Cell, target: str | None, seconds: float | None = None
) -> tuple[Factory, str]:
    """The engine ``fuzz`` drives (the reference engine, or ``target``'s factory, built once on
    a small config: ``ValueError`` when it is not an adapter) and how its traces are judged
    (strict or observed), known before any fuzzing. With ``seconds`` (the fuzzing's budget) the
    adapter is also checked against the protocol (``protocol.check_adapter``), within
    ``PROTOCOL_CHECK_SECONDS`` and the budget."""
    from kvspec.conformance import watchdog
    from kvspec.conformance.adapter import load_factory, probe, reference
    from kvspec.conformance.fuzz import DataChoices
    from kvspec.conformance.protocol import check_adapter

    if not target:
        return reference, "strict"
    factory = load_factory(target)
    config = _probe_config(cell)
    adapter = probe(factory, config, DataChoices(), target, cell.loads)
    claimed = getattr(adapter, "config", config)
    for name, flag in (("spec_tokens", "--spec-tokens"), ("sliding_window", "--sliding-window")):
        if getattr(claimed, name) != getattr(config, name):
            raise ValueError(
                f"--target {target}: the engine does not run {flag} (its {name} "
                f"is {getattr(claimed, name)})"
            )
    if seconds is not None:  # before fuzzing: the protocol (bad input, never a finding)
        try:
            with watchdog.time_limit(min(seconds, PROTOCOL_CHECK_SECONDS)):
                check_adapter(factory, config, target)
        except watchdog.OutOfTime:
            pass  # an engine call that does not return: the fuzzing reports it, with its stack
    return factory, getattr(adapter, "judging", "strict")


def simulate(
    config: Config, requests: int, seed: int = 0
) -> tuple[list[Event], dict[str, int], float]:
    """workload -> engine -> events: the reference engine on a shared-prefix workload; its events,
    its counters and the seconds it ran."""
    import time

    from kvspec.reference import Engine, EngineConfig
    from kvspec.reference.workload import shared_prefix_workload

    fields = {
        name: getattr(config, name)
        for name in EngineConfig.__dataclass_fields__
        if hasattr(config, name)
    }
    from kvspec.conformance.adapter import engine_traits

    engine = Engine(EngineConfig(**fields, policy_traits=engine_traits(config)))
    started = time.perf_counter()
    bsz = config.block_size
    for rid, prompt, max_tokens, priority in shared_prefix_workload(
        requests, 4, 8 * bsz, bsz, 8, seed
    ):
        engine.add_request(rid, prompt, max_tokens, priority)
    while engine.step():
        pass
    return engine.events, engine.stats, time.perf_counter() - started


def write(
    path: str | Path, config: Config, events: list[Event], version: int, judging: str = "strict"
) -> int:
    """events -> disk: a v1 trace (with opaque hashes, as a real engine's) or a v0 event file."""
    from kvspec.conformance.trace import write_events, write_trace

    if version == 1:
        return write_trace(path, config, events, hashes=True, judging=judging)
    if judging != "strict":
        raise ValueError(f"--format v0 has no judging field for this {judging} engine; use v1")
    return write_events(path, config, events)


def adapter_check(target: str, policy: str | None = None) -> tuple[int, Cell]:
    """adapter -> protocol: build ``target``'s adapter and check every method's results and
    every event it emits on a small workload (``protocol.check_adapter``; ``ProtocolError`` at
    the first problem). ``policy`` None: the first cell (policy, discipline) the factory does not
    refuse (discipline vllm or general, depth 1 or 2). The number of events checked and the
    cell."""
    from kvspec.conformance.adapter import load_factory
    from kvspec.conformance.protocol import ProtocolError, check_adapter
    from kvspec.spec import OBSERVED_POLICIES, POLICIES

    factory = load_factory(target, from_cwd=True)
    refused = ""
    for name in (policy,) if policy else (*POLICIES, *OBSERVED_POLICIES):
        for discipline, depth in itertools.product(("vllm", "general"), (1, 2)):
            cell = Cell(name, discipline, depth=depth)
            try:
                return check_adapter(factory, _probe_config(cell), target), cell
            except ProtocolError:
                raise
            except ValueError as err:  # the factory refuses the cell: the next one
                if "the factory failed" in str(err) or "is not an adapter" in str(err):
                    raise
                if not refused:
                    refused = str(err)
    raise ValueError(refused)


def _probe_config(cell: Cell) -> Config:
    """The configuration an adapter is probed with before fuzzing."""
    return Config(
        num_blocks=8,
        block_size=4,
        depth=cell.depth or (2 if cell.overlaps else 1),
        policy=cell.policy,
        discipline=cell.discipline,
        preemption=cell.preemption,
        stop_token=0,
        async_scheduling=cell.async_scheduling,
        stale_output=cell.stale_output,
        prefix_caching=cell.prefix_caching,
        spec_tokens=cell.spec_tokens,
        sliding_window=cell.sliding_window,
    )


def check(
    paths: list[str], check_every: int = 1, engine: str = "fast", observed: bool = False
) -> Iterator[Report]:
    """events -> verdict: judge each trace file; its ``report.Report`` (``observed``: with
    observed matching, whatever the file's header says)."""
    from kvspec.conformance.check import check_file

    for path in paths:
        yield _read_as_file(
            path, lambda real: check_file(real, check_every, engine, observed=observed)
        )


def check_kv_events(
    paths: list[str], invariants: list[str] | None = None, capacity: int | None = None
) -> Iterator[Report]:
    """native KV events -> verdict: judge each capture of an engine's KV-event stream (what a
    router is told) with the stream's spec (``spec/stream.py``); its ``report.Report``."""
    from kvspec.conformance.kvevents.stream_judge import check_capture

    for path in paths:
        yield _read_as_file(path, lambda real: check_capture(real, invariants, capacity))


def _read_as_file(path: str, judge: Callable[[str], Report]) -> Report:
    """``judge``'s report of ``path``, a file or a stream (``-``, a pipe: read through a
    temporary copy, ``conformance/inputs.py``), named as the user named it."""
    from kvspec.conformance.inputs import name_of, relabel, seekable
    from kvspec.conformance.report import Report

    try:
        with seekable(path) as real:
            return relabel(judge(real), real, path)
    except (OSError, ValueError) as err:
        return Report(name_of(path), 2, error=str(err))


def replay(path: str | Path, options: Options) -> tuple[Config, Result]:
    """events -> tensors: replay a trace's plan on a paged KV cache, every attention output
    compared with dense attention (``impl/paged/replay.py``). Its config and the result. Every
    size is priced against the memory budget before it is allocated (``budget.py``): the file
    read whole, then the tensors of the cache and of the largest step's dense attention."""
    from kvspec.conformance import budget
    from kvspec.conformance.plan import PlanError, replay_plan
    from kvspec.conformance.trace import TraceError, open_trace
    from kvspec.impl.paged.replay import replay as run

    with open_trace(path) as trace:
        try:
            budget.check_read_whole(path, "reading the trace whole")
        except budget.OverBudget as err:
            raise TraceError(path, 1, err.reason) from None
        config = trace.config
        events = [event for _, event, _ in trace.events()]
        judging = trace.judging
    try:
        plan = replay_plan(config, events, judging)
    except PlanError as err:
        raise ValueError(f"{path}:{err.index + 2}: {err.reason}") from None
    largest = max((sum(w.end for w in getattr(r, "work", ())) for r in plan), default=0)
    parts = budget.replay_need(
        config.num_blocks,
        config.block_size,
        options.num_layers,
        options.num_heads,
        options.num_kv_heads,
        options.head_dim,
        options.dtype.itemsize,
        largest,
    )
    budget.require_all(parts, "replaying it on tensors", str(path))
    return config, run(plan, config.num_blocks, config.block_size, options)


def demo(seconds: float, seed: int = 0, full: bool = True) -> Iterator[CellResult | CellError]:
    """Every cell of the verdict table (``full``; else its synchronous cells, ``QUICK_CELLS``)
    fuzzed for ``seconds`` each (``conformance/verdicts.py``); a ``CellError`` for a cell whose
    fuzzing raised (an internal error, not a verdict)."""
    from kvspec.conformance.verdicts import CELLS, QUICK_CELLS, all_cells

    yield from all_cells(seconds, seed, cells=CELLS if full else QUICK_CELLS)
