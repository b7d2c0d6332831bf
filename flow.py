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
events -> verdict              ``judge/`` (the spec, or its fast twin), reported by
                               ``conformance/report.py`` and ``conformance/html.py``
native KV events -> verdict    ``spec/stream.py`` (what a router may be told),
                               ``conformance/kvevents/`` (captures, live ZMQ, while fuzzing)
events -> tensors              ``conformance/plan.py`` (the spec's plan), ``impl/paged/replay.py``
=============================  ==============================================================

=================  ===========================================================================
command            its call here
=================  ===========================================================================
``fuzz``           ``fuzz`` (a ``Cell``, ``cell.py``: what runs, spelled once), ``witness``
``adapter-check``  ``adapter_check``
``simulate``       ``simulate`` (a ``Cell``'s ``Config``), ``write``
``replay``         ``replay``
``prove``          ``prove`` (a ``Cell`` and ``ProveSizes``)
``check``          ``check_all`` (``check``, ``check_kv_events``), ``witness_file``
``watch``          ``watch``
``which-policy``   ``which_policy``
``generate``       ``generate``
``demo``           ``demo`` (the verdict table's cells, ``conformance/verdicts.py``)
=================  ===========================================================================

Answers with several parts are named records (``Fuzzed``, ``Simulated``, ``AdapterChecked``,
``Replayed``, ``Generated``; tuples, so that unpacking them still works). Each function imports
what it uses when it is called, so that a command loads only its own arrow (``kvspec check`` no
torch, ``kvspec fuzz`` no z3).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kvspec.cell import Cell
from kvspec.spec import Config

if TYPE_CHECKING:
    from hypothesis.database import ExampleDatabase

    from kvspec.conformance.adapter import Factory
    from kvspec.conformance.fuzz import CellResult, Failure
    from kvspec.conformance.report import Report
    from kvspec.conformance.verdicts import CellError
    from kvspec.conformance.which import Cell as Conformance
    from kvspec.conformance.witness import Witness
    from kvspec.impl.llm.engine import LLM, Output
    from kvspec.impl.llm.sampling import SamplingParams
    from kvspec.impl.paged.replay import Options, Result

Event = tuple[object, ...]


class Fuzzed(NamedTuple):
    """``fuzz``'s answer: the cell's result and how the engine's traces are judged."""

    result: CellResult
    judging: str


def admissible(cell: Cell, target: str | None, groups: bool = False) -> None:
    """Refuse (``ValueError``, bad input) a cell no engine can run as asked: an observed policy
    without an engine that registers on its own, ``--async`` at depth 1. Every fuzzer calls it
    before it starts (``fuzz`` here, ``conformance/fuzz_groups.py`` through ``cli``, with
    ``groups``: the reference engine registers on its own there, judged observed)."""
    from kvspec.spec import OBSERVED_POLICIES

    if cell.policy in OBSERVED_POLICIES and not target and not groups:
        raise ValueError(
            f"--policy {cell.policy} needs --target (an engine that registers blocks on its "
            "own), or --groups of several groups (e.g. full,slot): the reference engine's own "
            "registration is fuzzed there, judged observed (a single group under it runs in "
            "tests/test_reference_slots.py)"
        )
    cell.run_depth()  # --async with --depth 1 is bad input


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
    from_cwd: bool = False,
    strict_only: str | None = None,
) -> Fuzzed:
    """workload -> engine -> events -> verdict: lockstep-fuzz an engine (the reference engine, or
    ``target``, an adapter factory ``module:factory``) against the spec for ``seconds``. The
    result (``fuzz.CellResult``) and how the engine's traces are judged (strict or observed).
    ``database``: Hypothesis's example database; ``shrink=False`` reports the first
    counterexample as found; ``bounded``: ``seconds`` bounds shrinking too and a hung engine
    call is a finding (``fuzz.run_cell``). A ``target``'s adapter is checked against the
    protocol first (``probe_target``: its mistakes are bad input, ``ProtocolError``, never a
    finding); ``check_protocol``: also every call of every run. ``from_cwd``: ``target`` is
    imported as ``python -m`` would (the current folder first: the command line).
    ``strict_only``: what needs strict judging (``--format v0``, which has no judging field):
    an engine judged otherwise is bad input, before any fuzzing. A cell that needs an engine
    registering on its own without a ``target``, or an overlap below depth 2, is bad input
    (``ValueError``)."""
    from kvspec.conformance.adapter import load_factory
    from kvspec.conformance.fuzz import fuzz_cell
    from kvspec.conformance.protocol import checking

    admissible(cell, target)
    if target and from_cwd:
        load_factory(target, from_cwd=True)
    factory, judging = probe_target(cell, target, seconds)
    if strict_only and judging != "strict":  # before fuzzing, so that no finding is lost to it
        raise ValueError(
            f"{strict_only} has no judging field for this {judging} engine "
            f"(--target {target}); use --format v1"
        )
    if check_protocol:
        factory = checking(factory)
    result = fuzz_cell(
        cell,
        seconds,
        seed,
        invariants=invariants,
        factory=factory,
        database=database,
        shrink=shrink,
        bounded=bounded,
    )
    return Fuzzed(result, judging)


def witness(failure: Failure, judging: str) -> Witness:
    """A counterexample's events as ``--out`` writes them: extended, for a NoUnwrittenPublish,
    with a consumer that reads the zombie block (``witness.extend``)."""
    from kvspec.conformance.witness import extend

    finding = failure.finding
    return extend(failure.config, failure.events, finding.invariant, finding.event, judging)


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
    from kvspec.cell import not_kept
    from kvspec.conformance import watchdog
    from kvspec.conformance.adapter import load_factory, probe, reference
    from kvspec.conformance.fuzz import DataChoices
    from kvspec.conformance.protocol import check_adapter

    if not target:
        return reference, "strict"
    factory = load_factory(target)
    config = cell.probe_config()
    adapter = probe(factory, config, DataChoices(), target, cell.loads)
    refusal = not_kept(config, getattr(adapter, "config", config))
    if refusal is not None:
        raise ValueError(f"--target {target}: {refusal}")
    if seconds is not None:  # before fuzzing: the protocol (bad input, never a finding)
        try:
            with watchdog.time_limit(min(seconds, PROTOCOL_CHECK_SECONDS)):
                check_adapter(factory, config, target)
        except watchdog.OutOfTime:
            pass  # an engine call that does not return: the fuzzing reports it, with its stack
    return factory, getattr(adapter, "judging", "strict")


class Simulated(NamedTuple):
    """``simulate``'s answer: the engine's events, its counters and the seconds it ran."""

    events: list[Event]
    stats: dict[str, int]
    seconds: float


def simulate(config: Config, requests: int, seed: int = 0) -> Simulated:
    """workload -> engine -> events: the reference engine on a shared-prefix workload, its
    memory priced against the budget first (``budget.simulate_need``)."""
    import time

    from kvspec.conformance import budget
    from kvspec.conformance.adapter import engine_config

    size = f"{config.num_blocks:,} blocks of {config.block_size:,} tokens"
    need = budget.simulate_need(requests, config.num_blocks, config.block_size)
    budget.require(need, f"{requests:,} requests on {size}")
    from kvspec.reference import Engine
    from kvspec.reference.workload import shared_prefix_workload

    engine = Engine(engine_config(config))
    started = time.perf_counter()
    bsz = config.block_size
    for rid, prompt, max_tokens, priority in shared_prefix_workload(
        requests, 4, 8 * bsz, bsz, 8, seed
    ):
        engine.add_request(rid, prompt, max_tokens, priority)
    while engine.step():
        pass
    return Simulated(engine.events, engine.stats, time.perf_counter() - started)


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


class AdapterChecked(NamedTuple):
    """``adapter_check``'s answer: the number of events checked and the cell they ran."""

    events: int
    cell: Cell


def adapter_check(target: str, policy: str | None = None) -> AdapterChecked:
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
                return AdapterChecked(check_adapter(factory, cell.probe_config(), target), cell)
            except ProtocolError:
                raise
            except ValueError as err:  # the factory refuses the cell: the next one
                if "the factory failed" in str(err) or "is not an adapter" in str(err):
                    raise
                if not refused:
                    refused = str(err)
    raise ValueError(refused)


class ProveSizes(NamedTuple):
    """The sizes ``prove``'s bounded symbolic model is built for (the depth is the cell's)."""

    blocks: int = 4
    requests: int = 2
    bound: int = 8


def prove(
    cell: Cell,
    sizes: ProveSizes | None = None,
    out: str | None = None,
    timeout_s: float = 120.0,
    method: str = "auto",
    all_sizes: bool = False,
) -> int:
    """spec -> proof: the cell's policy, discipline, preemption and timing proved with Z3 (an
    inductive proof, else bounded model checking; ``all_sizes``: the parametric model, for every
    size); it prints its verdict and answers the exit code (0 proof, 1 counterexample, 3
    unknown)."""
    sizes = sizes or ProveSizes()
    if all_sizes:
        from kvspec.proofs.all_sizes import run_all_sizes

        return run_all_sizes(
            cell.policy,
            cell.discipline,
            cell.preemption,
            async_scheduling=bool(cell.async_scheduling),
            stale_output=cell.stale_output or "drop",
            spec_tokens=cell.spec_tokens,
            out=out,
            timeout_s=timeout_s,
        )
    from kvspec.proofs.prove import run_prove

    return run_prove(
        cell.policy,
        cell.discipline,
        cell.preemption,
        sizes.blocks,
        sizes.requests,
        cell.depth or 2,
        sizes.bound,
        out,
        timeout_s,
        method=method,
        async_scheduling=bool(cell.async_scheduling),
        stale_output=cell.stale_output or "drop",
    )


def which_policy(path: str) -> tuple[list[Conformance], Report | None]:
    """events -> verdicts: judge a trace (a file or a stream) under every policy and discipline
    (``which.which_policy``); each one's verdict, or the report of an unreadable trace."""
    from kvspec.conformance.inputs import seekable
    from kvspec.conformance.which import which_policy as judge_under_each

    with seekable(path) as real:
        return judge_under_each(real)


def watch(
    endpoint: str,
    replay: str | None,
    topic: str,
    capture: str | None,
    blocks: int | None,
    invariants: list[str] | None,
    seconds: float | None,
    as_json: bool,
    known: Iterable[str] = (),
) -> int:
    """native KV events (live) -> verdict: judge an engine's KV-event stream over ZMQ as it
    comes (``kvevents/watch.py``); it prints its report and answers the exit code."""
    from kvspec.conformance.kvevents.watch import watch as watch_stream

    return watch_stream(
        endpoint, replay, topic, capture, blocks, invariants, seconds, as_json, known=known
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
    paths: list[str],
    invariants: list[str] | None = None,
    capacity: int | None = None,
    known: Iterable[str] = (),
) -> Iterator[Report]:
    """native KV events -> verdict: judge each capture of an engine's KV-event stream (what a
    router is told) with the stream's spec (``spec/stream.py``); its ``report.Report``
    (``known``: engine findings read by name, ``kvevents/known_findings.py``)."""
    from kvspec.conformance.kvevents.stream_judge import check_capture

    for path in paths:
        yield _read_as_file(path, lambda real: check_capture(real, invariants, capacity, known))


def check_all(
    traces: list[str],
    kv_events: list[str],
    check_every: int = 1,
    engine: str = "fast",
    observed: bool = False,
    stream_invariants: list[str] | None = None,
    capacity: int | None = None,
    known: Iterable[str] = (),
) -> list[Report]:
    """``kvspec check``: the reports of the ``traces`` (``check``), then of the KV-event
    captures (``check_kv_events``), in the order named."""
    reports = list(check(traces, check_every, engine, observed))
    return reports + list(check_kv_events(kv_events, stream_invariants, capacity, known))


def witness_file(report: Report, out: str) -> str:
    """events -> tensors' input: a trace whose finding is a NoUnwrittenPublish, extended with a
    consumer that reads the zombie block and written to ``out`` (``witness.extend_file``); what
    was written, in words."""
    from kvspec.conformance.witness import extend_file

    return extend_file(report.path, report.invariant, report.line, out)


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


class Replayed(NamedTuple):
    """``replay``'s answer: the trace's configuration and the replay's result."""

    config: Config
    result: Result


def replay(path: str | Path, options: Options) -> Replayed:
    """events -> tensors: replay a trace's plan on a paged KV cache, every attention output
    compared with dense attention (``impl/paged/replay.py``). Its config and the result. Every
    size is priced against the memory budget before it is allocated (``budget.py``): the file
    read whole, then the tensors of the cache and of the largest step's dense attention."""
    from kvspec.conformance import budget
    from kvspec.conformance.plan import PlanError, replay_groups, replay_plan
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
    groups = replay_groups(config)
    if len(groups) > options.num_layers:  # layer i belongs to group i % G: one layer each
        options = dataclasses.replace(options, num_layers=len(groups))
    parts = budget.replay_need(
        config.num_blocks,
        max(g.block_size for g in groups),  # every group's cache priced at the largest block
        options.num_layers,
        options.num_heads,
        options.num_kv_heads,
        options.head_dim,
        options.dtype.itemsize,
        largest,
    )
    budget.require_all(parts, "replaying it on tensors", str(path))
    return Replayed(config, run(plan, config.num_blocks, config.block_size, options, groups))


class LlmSetup(NamedTuple):
    """How ``generate``'s engine runs: its policy, steps in flight, attention backend (auto,
    triton, torch) and sampling seed."""

    policy: str = "deferred"
    depth: int = 1
    backend: str = "auto"
    seed: int = 0


class Generated(NamedTuple):
    """``generate``'s answer: the engine (its weights, backend, cache), the outputs and the
    seconds generating took."""

    llm: LLM
    outputs: list[Output]
    seconds: float


def generate(
    model: str,
    prompts: list[str],
    params: SamplingParams,
    setup: LlmSetup | None = None,
    on_load: Callable[[str], None] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> Generated:
    """workload -> engine -> tensors: a Llama model through the reference engine's block manager
    and the paged kernels (``impl/llm/``), its weights priced against the memory budget first."""
    import time

    from kvspec.conformance import budget
    from kvspec.impl.paged.replay import use_interpreter_without_gpu

    setup = setup or LlmSetup()
    budget.require(budget.weights_need(model), f"loading {model} as float32", "--model")
    if setup.backend == "triton":
        use_interpreter_without_gpu()  # before anything imports triton
    from kvspec.impl.llm.engine import LLM

    llm = LLM(
        model,
        policy=setup.policy,
        depth=setup.depth,
        backend=setup.backend,
        seed=setup.seed,
        on_load=on_load,
    )
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, on_step=on_step)
    return Generated(llm, outputs, time.perf_counter() - started)


def demo(seconds: float, seed: int = 0, full: bool = True) -> Iterator[CellResult | CellError]:
    """Every cell of the verdict table (``full``; else its synchronous cells, ``QUICK_CELLS``)
    fuzzed for ``seconds`` each (``conformance/verdicts.py``); a ``CellError`` for a cell whose
    fuzzing raised (an internal error, not a verdict)."""
    from kvspec.conformance.verdicts import CELLS, QUICK_CELLS, all_cells

    yield from all_cells(seconds, seed, cells=CELLS if full else QUICK_CELLS)
