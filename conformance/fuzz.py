"""Lockstep stateful fuzzing: Hypothesis generates workloads, drives an engine, the spec judges.

The arrow "workload drives engine" lives here. ``lockstep_machine`` builds a Hypothesis
``RuleBasedStateMachine`` for one cell (policy, discipline, preemption, depth, async scheduling,
stale output): a workload (requests arriving with shared prefixes, engine steps, aborts,
prefix-cache resets) and every nondeterministic choice the engine makes (which request a general
scheduler admits or preempts, which external KV loads fail) are drawn by Hypothesis, so failures
shrink. After every action, the engine's new events go through a ``Judge`` and its refcounts and
free queue are compared with the spec's (by the fast model, whose findings the spec judge
re-judges and reports, ``run_judge``). ``run_cell`` runs a machine for a time budget and
returns what it found, how many engine steps each run took and what the runs reached
(``fuzz_coverage.py``).

The machine class is the public face (HypoFuzz runs its ``TestCase``, tests run it through
``run_state_machine_as_test``), but ``run_cell`` does not drive it through Hypothesis's stateful
runner: ``lockstep_test`` is a plain ``@given(st.data())`` test that makes an instance of the
machine's plain ``run_class``, calls ``setup`` (the configuration, drawn directly), then, for each
action, opens a span and makes one choice that either stops the run (``STOP``, forced once the
step count is reached, as the stateful runner forces its stop boolean) or names the kind of the
action, and calls ``perform``, ``agree`` and, at the end, ``teardown``. The logic stays in the
run's methods, one copy (the machine's rules call them); the choice sequence keeps the stateful
runner's shape (one span per action), so the shrinker still deletes whole actions; and the
runner's per-step work (choosing among rules, drawing a fresh ``st.data()`` object, printing and
timing support), which cost more than the engine and the judge together, is gone.
``run_cell`` ends a batch of examples when the time is up (``BudgetSpent``). Why each choice
and setting was made, with the figures: docs/fuzzing.md, "Where the fuzzer's time goes".

The machine is built so that Hypothesis draws little per engine decision (its drawing machinery
used to take most of the time, and runs were a few engine steps long):

* one rule, ``act``, always enabled: the kind of action is one integer choice into the run's mix
  (``MIXES``, drawn once per run: swarm testing by table, instead of Hypothesis's feature flags
  and preconditions, which cost draws and ``_rule_is_enabled`` calls per rule and disabled the
  ``step`` or ``arrive`` rule in many runs, which then did nothing); under ``lockstep_test``
  that choice also holds the stop (``ACTIONS``, ``STOP``);
* every choice is one integer straight from the choice sequence (``_draw_integer``): no
  ``.filter``, no lists, no strategy per draw; the engine's own choices (``DataChoices.pick``)
  too. An action's parameters stay choices of their own (folding a step's count or an arrival's
  budget into the kind's choice, one choice per action, shrank the seed bug's counterexamples
  longer). An arrival is three choices, each an index into a table ordered simplest first: how its
  prompt opens (``OPENINGS``: a shared prefix and how much of it), its own suffix
  (``PROMPT_SUFFIXES``, shorter first) and its (max new tokens, priority) (``BUDGETS``), plus
  one for an external load under ``loads`` (against one choice per field, over several seeds
  of the seeded bugs, counterexamples shrank shorter on average, though not on every seed; one
  choice of bytes for all of them, cheaper, shrank the seed bug longer: docs/fuzzing.md);
* no choice is drawn where it cannot change anything: a ``step`` action runs one engine step,
  and only if the engine was not idle draws how many more (``STEP_COUNTS``, up to 8 in all;
  an idle engine ends them, and an idle step is not recorded: counterexamples are not padded
  with them); an abort draws which live request only when there are two or more; the snapshot
  comparison runs once per action, the judge's invariant checks after every decision as before;
* under the vLLM discipline, no action is spent on a kind that can do nothing now (a step of
  an engine known to be idle, an abort with no live request, a reset while requests are live):
  ``perform`` replaces it by the next kind of the mix that can (``able``), so a value that names
  a kind the state allows means that kind, as before; the simplest action value (``SIMPLEST``)
  is a step as drawn, so that the shrinker can still lower an action to one that does nothing
  (under the general discipline, whose scheduler draws its own choices, a seeded bug then
  shrank longer: runs there are as before);
* under the vLLM discipline, when a run stops, its requests are run to the end (``run_out``:
  the engine steps until idle, judged, one program entry), engine work and judging at no choice
  of the driver's: a run's tail (requests finishing, freeing, caching) is explored in every
  run, not only in runs whose last actions happen to be steps.

A counterexample of an eager policy is usually found as ``NoUnwrittenPublish`` (the zombie's
publication), before any request reads it. To see the read itself (``NoUnwrittenRead``: the
wrong K/V a model would attend to), judge with the publish invariant off, ``kvspec fuzz
--invariant NoUnwrittenRead``, so that the fuzzer must drive on to a reader. We chose that over
a targeting score (``hypothesis.target``): ``run_cell`` runs seeded batches of examples without
the target phase (a score would cost a call per example, and its climb needs long runs), while
an invariant left out costs nothing and keeps the search seeded; ``fuzz_coverage.RunCoverage``
counts the zombie hits the runs reach. (Arrivals that copy an earlier request's prompt, to make
such a reader likelier, were tried: they make one action depend on another, and counterexamples
shrank worse.)
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, fields
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, reject, seed, settings
from hypothesis import strategies as st
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Unsatisfiable
from hypothesis.internal.reflection import function_digest
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    invariant,
    rule,
)

from kvspec.cell import Cell, OfCell
from kvspec.judge import Finding, Judge
from kvspec.judge.consequence import Consequence, explain
from kvspec.judge.core import FAST_INVARIANTS
from kvspec.spec import STALE_OUTPUTS, Config

from . import watchdog
from .adapter import Factory, reference
from .engine_view import compare_view
from .fuzz_coverage import Coverage, RunCoverage
from .monitor import Monitor
from .protocol import AdapterMistake, ProtocolError

Event = tuple[object, ...]

PREFIXES = ((1, 2, 3, 1, 2, 3, 1, 2), (2, 2, 1, 1, 3, 3, 2, 2), (3, 1, 3, 1, 2, 1, 2, 1))
"""Shared "system prompts": requests that start with the same one share prefix blocks."""

MAX_NEW_TOKENS = 6
"""The most tokens a request may generate (capped so that it fits the pool). 12 doubles the
preemptions from the step being built, but the seed bug's counterexamples then shrink worse."""

SUFFIX_TOKENS = 5
"""The longest own suffix of a prompt, after its shared prefix."""

SUFFIXES = tuple(
    tuple(tuple(1 + (i // 3**k) % 3 for k in range(n)) for i in range(3**n))
    for n in range(SUFFIX_TOKENS + 1)
)
"""``SUFFIXES[n]``: every suffix of ``n`` tokens from 1..3, all ones first (the simplest); in a
row, they are ``PROMPT_SUFFIXES``: a suffix is one integer choice, not a list of drawn tokens."""

OPENINGS = ((0, 0),) + tuple((p, n) for n in range(1, 9) for p in range(len(PREFIXES)))
"""(which of ``PREFIXES``, how many of its tokens) an arrival's prompt starts with, one choice:
fewer shared tokens first, none (the simplest) at 0."""

PROMPT_SUFFIXES = tuple(suffix for table in SUFFIXES for suffix in table)
"""Every own suffix of a prompt, shorter first (then as in ``SUFFIXES``): one choice."""

BUDGETS = tuple((m, p) for m in range(1, MAX_NEW_TOKENS + 1) for p in range(4))
"""(max new tokens, priority) of an arrival, one choice: fewer tokens first, then priority."""

STEP_COUNTS = tuple(range(1, 9))
"""How many engine steps one ``step`` action runs (at most: an idle engine ends them), drawn
after its first step. Every count, not a coarse table (1, 2, 4, ... 16 ran more steps per draw,
but the shrinker could then not drop a single step, and counterexamples stayed several times
longer)."""

MIXES = (
    ("step", "arrive", "step", "arrive", "step", "arrive", "abort", "reset"),
    ("step", "arrive", "arrive", "step", "arrive", "arrive", "step", "abort"),
    ("step", "arrive", "abort", "step", "arrive", "abort", "step", "reset"),
    ("step", "arrive", "step", "step", "arrive", "step", "arrive", "reset"),
)
"""The kinds of action a run draws from, one mix per run (drawn first): balanced, arrival-heavy
(memory pressure, preemptions), abort-heavy, step-heavy (long requests run to the end). Swarm
testing by table: one choice per action picks the kind, and no rule is ever disabled. Every mix
starts with ``step``: the shrinker lowers a kind to the first, and a step of an idle engine does
nothing (it is not even recorded), whereas an arrival it cannot delete would stay in the
counterexample."""

SLOT_VALUES = 31
"""How many values of ``lockstep_test``'s action choice stand for each slot of the run's mix."""

ACTIONS = len(MIXES[0]) * SLOT_VALUES
"""The action choice is an integer from 0 to ``ACTIONS`` (248): 0 (``STOP``) ends the run, ``v``
above it is the kind in slot ``(v - 1) // SLOT_VALUES`` of the mix. Below 256, where Hypothesis
draws an integer uniformly (beyond, its distribution favours small values), and 256 itself, a
literal in kvspec's source, would be drawn more often (``HypothesisProvider`` returns, 5% of the
time, an integer literal of at least 100 found in the tested modules): the most slots of 31
values. So a run stops early with probability 1/249 per action, and each kind is as likely as
its share of the mix (before ``perform`` replaces a kind that can do nothing now)."""

STOP = 0
"""The value of the action choice that ends a run: the stop and the kind of the action are one
choice (the stateful runner draws a "stop" boolean before each rule, then the rule draws the
kind). Forced after the run's last action. It is the simplest value: the shrinker's first try at
an action's choice is to end the run there, and Hypothesis's simplest examples (one per batch,
and the first few of each) stop at once instead of running as many idle steps as a run has
actions; and being below 100 it is never one of the literals Hypothesis draws more often."""

RUN_OUT_STEPS = 500
"""The most engine steps ``run_out`` takes with no request finishing (a bound, not a choice: never
drawn, so its being over 100 does not matter). Progress, not a total: a long workload under heavy
preemption may take more steps in all (26 requests thrashing over 3 blocks once took 500 and were
still finishing one by one: ``EngineNeverIdle`` was a false alarm), but an engine that in 500
steps finishes none of its live requests, or never goes idle with none, is livelocked."""

SIMPLEST = STOP + 1
"""The simplest action, the first value of the mix's first slot (a step in every mix): the one
value of the action choice whose kind is not replaced when it can do nothing (``perform``'s
``redirect``), so that the shrinker can still lower any action to a step that does nothing on an
idle engine (not even recorded), rather than to an arrival that would stay in the
counterexample."""


class TargetExited(ValueError):
    """The engine's factory raised ``SystemExit`` while a run was set up: bad input (exit 2)."""


class RunRefused(KeyboardInterrupt):
    """Raised inside a run when the engine's adapter refuses mid-run (its ``refusal``: a
    feature the spec does not model, seen only at run time). The search ends there, as at a
    factory's refusal: nothing after a refusal is judged. A ``KeyboardInterrupt``, as
    ``BudgetSpent``, so that Hypothesis lets it through without shrinking it; while a failure
    found earlier is being shrunk, a refused candidate is rejected instead."""

    def __init__(self, refusal: str) -> None:
        super().__init__(refusal)
        self.refusal = refusal


class CounterexampleFound(AssertionError):
    """Raised inside a run when the judge reports a finding."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(str(finding))
        self.finding = finding


def _draw_integer(data: Any) -> Callable[[int, int], int]:
    """``draw(lo, hi)``: one integer choice of Hypothesis, ``lo`` the simplest. Straight from the
    choice sequence under the ``st.data()`` object where this Hypothesis exposes it (one choice, no
    strategy machinery: the fuzzer's hot path), else through ``st.integers``."""
    conjecture = getattr(data, "conjecture_data", None)
    direct = getattr(conjecture, "draw_integer", None)
    if direct is not None:
        return lambda lo, hi: direct(lo, hi, shrink_towards=lo)  # type: ignore[no-any-return]
    return lambda lo, hi: int(data.draw(st.integers(lo, hi)))


class DataChoices:
    """The engine's nondeterministic choices, drawn by Hypothesis (0 is the simplest)."""

    def __init__(self) -> None:
        self.data: Any = None
        self.draw: Callable[[int, int], int] | None = None

    def pick(self, n: int, label: str) -> int:
        if n <= 1 or self.draw is None:
            return 0
        return self.draw(0, n - 1)

    def attach(self, data: Any) -> None:
        """Draw from ``data`` (an ``st.data()`` object), or, with None, answer 0."""
        self.data = data
        self.draw = None if data is None else _draw_integer(data)

    def use(self, draw: Callable[[int, int], int] | None) -> None:
        """Draw with ``draw`` (``_draw_integer``'s), or, with None, answer 0."""
        self.draw = draw


@dataclass
class Failure:
    """The last failing run: what the CLI prints and writes."""

    finding: Finding
    config: Config
    program: list[tuple[str, list[Event]]]
    events: list[Event]
    consequence: Consequence | None = None
    """A deviation's (``Disagreement``'s) consequence: what it breaks, judged on past it."""
    snapshots: list[tuple[int, Any]] = field(default_factory=list)
    """The engine's (events emitted, snapshot) after each action of the run."""


def consequence_of(
    finding: Finding, config: Config, events: list[Event], snapshots: list[tuple[int, Any]]
) -> Consequence | None:
    """A ``Disagreement``'s consequence over the run's events (its run to idle included), an
    ``Illegal``'s where the engine's effects followed get past it (``consequence.explain``);
    None for any other finding."""
    return explain(config, events, finding, snapshots)


ENGINE_FRAMES = 3
"""How many of the innermost frames of an engine's exception its ``EngineError`` names."""


def engine_error(err: BaseException, where: int) -> Finding:
    """An engine's exception as a finding: its type, its message (or that it has none) and the
    innermost frames below the fuzzer's call (file:line in function), innermost last."""
    frames = [
        frame for frame in traceback.extract_tb(err.__traceback__) if frame.filename != __file__
    ][-ENGINE_FRAMES:]
    named = tuple(f"{_short(frame.filename)}:{frame.lineno} in {frame.name}" for frame in frames)
    text = " ".join(str(err).split()) or "(no message)"
    where_text = f" at {named[-1]}" if named else ""
    calls = f" (called from {'; '.join(reversed(named[:-1]))})" if len(named) > 1 else ""
    return Finding(
        "EngineError",
        f"{type(err).__name__}: {text}{where_text}{calls}",
        where,
        error_type=type(err).__name__,
        frames=named,
    )


def _short(path: str) -> str:
    """A source path from its package folder on (``.../site-packages/vllm/x.py``: ``vllm/x.py``)."""
    parts = path.replace("\\", "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    return "/".join(parts[-3:])


def named_invariant(finding: Finding, consequence: Consequence | None) -> str:
    """The property a failing run is shrunk for: the invariant it (or its deviation) breaks,
    else its kind of finding."""
    if consequence is not None and consequence.invariant is not None:
        return consequence.invariant
    return finding.invariant


@dataclass
class Tally:
    """Counts over all runs of a machine class (for the demo's lost-hit rate)."""

    runs: int = 0
    commits: int = 0
    lost_hits: int = 0
    failure: Failure | None = None
    first_failure_at: float | None = None
    first_failure_length: int | None = None
    target: str | None = None
    """``named_invariant`` of the first failing run: a later run that names another is not a
    failure of the one being shrunk."""
    """Workload steps of the first failing run, before shrinking."""
    best: Failure | None = None
    """The failing run with the fewest workload steps so far (what is reported when shrinking
    is cut short: the budget, Ctrl-C)."""
    started: float = field(default_factory=time.monotonic)
    steps_per_run: list[int] = field(default_factory=list)
    """Engine steps (commits) of each run, in order."""
    coverage: Coverage = field(default_factory=Coverage)
    refusal: str | None = None
    """The adapter's refusal that ended the search (``RunRefused``), or None."""


def timings(
    depth: int | None, async_scheduling: bool | None, stale_output: str | None
) -> st.SearchStrategy[tuple[bool, str, int]]:
    """(async scheduling, stale output, depth) of a cell; None draws the setting. A drawn depth
    is 1 to 3, or 2 to 3 with async scheduling or delivered stale output (at depth 1 neither
    differs from the synchronous engine); an explicit one must be >= 2 for them (ValueError)."""
    if depth is not None and depth < 2 and (async_scheduling or stale_output == "deliver"):
        raise ValueError(
            f"depth {depth}: async scheduling and delivered stale output need depth >= 2"
        )

    def depths(overlap: bool) -> st.SearchStrategy[int]:
        return st.just(depth) if depth is not None else st.integers(2 if overlap else 1, 3)

    if async_scheduling is not None and stale_output is not None:
        return depths(async_scheduling or stale_output == "deliver").map(
            lambda d: (async_scheduling, stale_output, d)
        )
    asyncs = st.booleans() if async_scheduling is None else st.just(async_scheduling)
    stales = st.sampled_from(STALE_OUTPUTS) if stale_output is None else st.just(stale_output)
    return st.tuples(asyncs, stales).flatmap(
        lambda t: depths(t[0] or t[1] == "deliver").map(lambda d: (t[0], t[1], d))
    )


def draw_timing(
    draw: Callable[[int, int], int],
    depth: int | None,
    async_scheduling: bool | None,
    stale_output: str | None,
) -> tuple[bool, str, int]:
    """(async scheduling, stale output, depth) of one run, as ``timings`` draws it, each a direct
    integer choice (``lockstep_test``'s configuration); the arguments are checked by ``timings``."""
    overlap = bool(draw(0, 1)) if async_scheduling is None else async_scheduling
    stale = STALE_OUTPUTS[draw(0, len(STALE_OUTPUTS) - 1)] if stale_output is None else stale_output
    if depth is None:
        depth = draw(2 if overlap or stale == "deliver" else 1, 3)
    return overlap, stale, depth


ENGINES = ("fast", "spec")


def run_judge(engine: Any, invariants: Collection[str] | None, how: str = "fast") -> Any:
    """The judge of one run: the arrow "the spec judges the events" for the fuzzer.

    ``how="fast"`` (the default) judges with the fast model, as ``kvspec check`` does: a
    ``Monitor.fast`` (``monitor.py``), whose finding is the spec judge's, re-judging the run's
    events (a run is far shorter than the Monitor's window, so from its first event) and agreeing
    on the invariant and the event, or ``FastPathDisagrees`` is raised. The spec judges the run
    itself (``Judge.spec``) where the fast model cannot: with ``how="spec"``, observed judging (an
    engine that registers on its own), an invariant the fast model does not evaluate (the
    bookkeeping ones, ``judge.core.FAST_INVARIANTS``), and an engine whose native KV-event stream
    is judged against the spec's state as it runs (``check_kv_stream``)."""
    config: Config = engine.config
    observed = getattr(engine, "judging", "strict") == "observed"
    fast_only = invariants is None or FAST_INVARIANTS.issuperset(invariants)
    if how == "spec" or observed or not fast_only or hasattr(engine, "check_kv_stream"):
        return Judge.spec(config, observed, invariants)
    return Monitor.fast(config, raise_on_finding=False, name="<fuzz>", invariants=invariants)


def _cell_of(arguments: dict[str, Any]) -> Cell:
    """The cell that ``lockstep_machine``'s or ``run_cell``'s ``arguments`` (their ``locals()``
    on entry) spell field by field: those named as ``Cell``'s fields, then ``other_fields``."""
    named = {k: v for k, v in arguments.items() if k in Cell.__dataclass_fields__}
    return Cell(**named, **arguments["other_fields"])


def lockstep_machine(
    policy: str,
    discipline: str = "vllm",
    preemption: str = "fcfs",
    depth: int | None = None,
    loads: bool = False,
    invariants: Collection[str] | None = None,
    factory: Factory = reference,
    async_scheduling: bool | None = False,
    stale_output: str | None = "drop",
    prefix_caching: bool = True,
    engine: str = "fast",
    **other_fields: Any,
) -> type[RuleBasedStateMachine]:
    """``cell_machine`` of the cell these fields make (``other_fields``: the ``Cell``'s other fields,
    e.g. ``spec_tokens``, ``sliding_window``), the spelling the tests and benches use."""
    cell = _cell_of(locals())
    return cell_machine(cell, invariants, factory, engine)


def cell_machine(
    cell: Cell,
    invariants: Collection[str] | None = None,
    factory: Factory = reference,
    engine: str = "fast",
) -> type[RuleBasedStateMachine]:
    """A state machine class for one cell; ``cell.depth`` None lets Hypothesis draw 1 to 3 (2 to
    3 under async scheduling or delivered stale output). With ``cell.loads``, some requests find
    their prompt in an external KV store and loads may fail. ``cell.async_scheduling`` and
    ``cell.stale_output`` are fixed, or drawn when None; every other field of the cell that is a
    ``Config`` field (``Cell.config``) is the configuration's, fixed for the cell. ``factory``
    builds the engine under test (``adapter.py``; default: the reference engine). ``engine``: how
    the runs are judged (``run_judge``)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    depth, loads, discipline = cell.depth, cell.loads, cell.discipline
    async_scheduling, stale_output = cell.async_scheduling, cell.stale_output
    spec_tokens = cell.spec_tokens
    timings(depth, async_scheduling, stale_output)  # the arguments' check (ValueError)
    tally = Tally()

    class LockstepRun:
        """One run of the cell: its engine, judge and program; ``lockstep_test`` drives it."""

        def setup(self, draw: Callable[[int, int], int]) -> None:
            """Draw the run's configuration (each field one integer choice, the simplest first:
            4 to 8 blocks of 2 or 4 tokens, ``draw_timing``, a token budget of 3 to 12, 2 to 4
            running requests, one of ``MIXES``) and build its engine and judge; a configuration
            the engine refuses (``ValueError`` from the factory) is rejected, not a finding."""
            num_blocks = draw(4, 8)
            block_size = (2, 4)[draw(0, 1)]
            overlap, stale, run_depth = draw_timing(draw, depth, async_scheduling, stale_output)
            drawn = dict(
                num_blocks=num_blocks,
                block_size=block_size,
                depth=run_depth,
                token_budget=draw(3, 12),
                max_running=draw(2, 4),
                stop_token=0,
                async_scheduling=overlap,
                stale_output=stale,
            )
            mix = MIXES[draw(0, len(MIXES) - 1)]
            self.choices = DataChoices()
            dog = watchdog.ACTIVE
            try:
                if dog is not None:
                    dog.calling = "factory"
                self.engine = factory(cell.config(**drawn), self.choices)
            except ValueError:  # a geometry or depth this engine does not run: not a finding
                reject()
            except SystemExit as err:  # a factory that exits: bad input, never "holds"
                raise TargetExited(f"the factory exited (SystemExit({err.code!r}))") from None
            finally:
                if dog is not None:
                    dog.calling = None
            self.config = self.engine.config
            self.coverage = coverage_of(self.config)
            self._refused()  # refused at construction, without a ValueError
            self.judge = run_judge(self.engine, invariants, engine)
            self.program: list[tuple[str, list[Event]]] = []
            self.snapshots: list[tuple[int, Any]] = []
            """(events emitted, the engine's snapshot) after each action: a deviation's
            consequence is judged with them (``judge/consequence.py``)."""
            self.next_id = 0
            self.mix = mix
            self.idle = True
            """Whether the engine's last step did nothing and no request arrived since (a fresh
            engine has nothing to do): a step action would do nothing (``able``)."""
            self.loads = loads
            k = spec_tokens
            self.reach = k + (run_depth - 1) * (k + 1) if k and overlap else k
            """Positions past a request's tokens its table may reach (its drafts, and under
            async scheduling those of the other steps in flight): kept free of prompts."""
            # several KV-cache groups share the pool: a request's token takes a block in each
            shares = max(1, len(self.config.groups))
            self.capacity = (num_blocks - 1) // shares * block_size - self.reach
            if self.capacity < 2:
                reject()  # no request of two tokens fits beside its drafts: not a finding
            tally.runs += 1

        def perform(
            self, slot: int, draw: Callable[[int, int], int], redirect: bool = True
        ) -> None:
            """The action of kind ``self.mix[slot]``, drawing its own choices with ``draw``: a
            step's count, an arrival's prompt and budget, an abort's request (the engine's own
            choices too, during steps). With ``redirect``, under the vLLM discipline, a kind
            that can do nothing now is replaced by the next kind of the mix that can (``able``).
            Not under the general discipline, whose scheduler draws its own choices: there the
            replacement made a seeded bug shrink longer (docs/fuzzing.md)."""
            if redirect and discipline == "vllm":
                slot = self.able(slot)
            kind = self.mix[slot]
            if kind == "step":
                self._steps(draw)
            elif kind == "arrive":
                self._arrive(draw)
            elif kind == "abort":
                self._abort(draw)
            elif not self.engine.live_requests():
                self._run("reset the prefix cache", self.engine.reset_prefix_cache)

        def able(self, slot: int) -> int:
            """``slot``, or, if its kind can do nothing now, the next slot of the mix (cyclically)
            whose kind can: a step needs an engine that is not known to be idle (``idle``: its
            last step did nothing and no request arrived since), an abort a live request, a reset
            none (``perform`` resets only then); an arrival always can. So an action choice that
            names a kind the state allows means that kind, as before, and none is spent on an
            action that does nothing."""
            mix = self.mix
            live: bool | None = None
            for i in range(len(mix)):
                at = (slot + i) % len(mix)
                kind = mix[at]
                if kind == "arrive" or (kind == "step" and not self.idle):
                    return at
                if kind != "step":
                    if live is None:
                        live = bool(self.engine.live_requests())
                    if (kind == "abort") == live:
                        return at
            return slot

        def _arrive(self, draw: Callable[[int, int], int]) -> None:
            which, shared = OPENINGS[draw(0, len(OPENINGS) - 1)]
            prefix = PREFIXES[which]
            suffix = PROMPT_SUFFIXES[draw(0, len(PROMPT_SUFFIXES) - 1)]
            max_tokens, priority = BUDGETS[draw(0, len(BUDGETS) - 1)]
            external = self.loads and draw(0, 1) == 1
            capacity = self.capacity
            max_tokens = min(max_tokens, capacity - 1)  # so that every request can finish
            prompt = (prefix[:shared] + suffix)[: capacity - max_tokens] or (1,)
            rid, self.next_id = self.next_id, self.next_id + 1
            self.idle = False
            self._run(
                f"r{rid} arrives: prompt {list(prompt)}, max {max_tokens} new tokens, "
                f"priority {priority}{', KV in the external store' if external else ''}",
                lambda: self.engine.add_request(rid, prompt, max_tokens, priority, external),
            )

        def _steps(self, draw: Callable[[int, int], int]) -> None:
            """One engine step, then, unless the engine was idle, as many more as one choice
            says (``STEP_COUNTS``, counting the first); an idle engine ends them (an idle step
            is not recorded). The count is drawn after the first step, so a step action of an
            idle engine draws nothing."""
            self.choices.use(draw)
            busy = self._run("engine step", self.engine.step, idle=False)
            if busy:
                for _ in range(STEP_COUNTS[draw(0, len(STEP_COUNTS) - 1)] - 1):
                    if not self._run("engine step", self.engine.step, idle=False):
                        busy = False
                        break
            self.idle = not busy
            self.choices.use(None)

        def _abort(self, draw: Callable[[int, int], int]) -> None:
            """Abort one live request, chosen among them (no choice when there is one)."""
            live = self.engine.live_requests()
            if live:
                rid = live[draw(0, len(live) - 1) if len(live) > 1 else 0]
                self._run(f"abort r{rid}", lambda: self.engine.abort(rid))

        def run_out(self, draw: Callable[[int, int], int]) -> None:
            """The end of a run under the vLLM discipline: the engine steps until it is idle,
            judged, as one program entry, at no choice of the driver's (the engine's own, whether
            an external load fails, drawn with ``draw`` as in a step action): a run's requests
            are all run to the end. Not under the general discipline, whose scheduler draws its
            admissions and preemptions: there a run out drawing them made a seeded bug shrink
            longer and slower (docs/fuzzing.md), and a run ends where its last action left it,
            as before."""
            if not hasattr(self, "judge") or discipline != "vllm":
                return
            self.choices.use(draw)
            steps = self._run("the engine runs until it is idle", self._until_idle, idle=0)
            self.choices.use(None)
            self.idle = True
            if steps is None:  # liveness: nothing new arrives, it must become idle
                live = self.engine.live_requests()
                self._raise_if(
                    Finding(
                        "EngineNeverIdle",
                        f"the engine still had work after {RUN_OUT_STEPS} steps with no new "
                        f"request and none finished ({len(live)} live: {live[:8]})",
                        self.judge.events_seen,
                    )
                )

        def _until_idle(self) -> int | None:
            """Step the engine until it is idle: the steps taken, or None when it went
            ``RUN_OUT_STEPS`` steps without a live request finishing (a livelock)."""
            steps, live = 0, len(self.engine.live_requests())
            while self.engine.step():
                steps += 1
                if steps % RUN_OUT_STEPS == 0:
                    now = len(self.engine.live_requests())
                    if now >= live:
                        return None
                    live = now
            return steps

        def agree(self) -> None:
            """The engine's own check, its refcounts and free queue against the judge's (or the
            judge's settled state), its native KV-event stream: a difference is a finding."""
            if not hasattr(self, "judge"):
                return
            self._refused()
            self_check = getattr(self.engine, "self_check", None)
            problem = self_check() if self_check is not None else None
            if problem is not None:
                self._raise_if(Finding("Disagreement", problem, self.judge.events_seen))
            snapshot = self.engine.snapshot()
            if snapshot is not None:
                self.snapshots.append((len(self.engine.events), snapshot))
            if snapshot is None:
                self._raise_if(self.judge.settle())
            else:
                self._raise_if(self.judge.compare(*snapshot))
                pool_view = getattr(self.engine, "pool_view", None)
                if pool_view is not None:  # the engine's own books (conformance/engine_view.py)
                    self._raise_if(
                        compare_view(pool_view(), self.judge.model, self.judge.events_seen)
                    )
            check_kv_stream = getattr(self.engine, "check_kv_stream", None)
            if (
                check_kv_stream is not None
            ):  # the engine's own KV-event stream (conformance/kvevents/engine_stream.py)
                self._raise_if(check_kv_stream(self.judge))

        def teardown(self) -> None:
            if not hasattr(self, "judge"):
                return
            model = self.judge.model
            state = getattr(model, "state", model)  # the fast model names its counts as State
            tally.commits += state.commits
            tally.lost_hits += state.lost_hits
            tally.steps_per_run.append(state.commits)
            self.coverage.unwritten_reads = len(state.bad_reads)
            tally.coverage.add(self.coverage)

        def _run(self, action: str, call: Callable[[], object], idle: object = None) -> object:
            """Run one engine call, record it with its events, judge them; what it returned.
            A call that returns ``idle`` and emits nothing (a step of an idle engine) is not
            recorded."""
            events = self.engine.events
            start = len(events)
            dog = watchdog.ACTIVE
            try:
                if dog is not None:
                    dog.calling = action
                result = call()
            except watchdog.EngineHung as hung:  # a finding, reported unshrunk (watchdog.py)
                self.program.append((action, events[start:]))
                where = self.judge.events_seen if hasattr(self, "judge") else 0
                self._record(Finding("EngineHung", hung.message, where), drain=False)
                raise
            except (Exception, SystemExit) as err:  # an engine that crashes (or exits) is a
                # finding, not a fuzzer crash
                emitted = events[start:]
                self.program.append((action, emitted))
                self._refused()
                # what it emitted before the exception is judged first: an earlier violation
                # is the finding, not masked by the crash it may have caused
                self._raise_if(self.judge.feed_all(emitted))
                self._raise_if(engine_error(err, self.judge.events_seen))
            finally:
                if dog is not None:
                    dog.calling = None
            self._refused()  # before its events are judged: none after a refusal is
            if len(events) == start:
                if result is not idle:
                    self.program.append((action, []))
                return result
            new = events[start:]
            self.program.append((action, new))
            self.coverage.observe(new)
            self._raise_if(self.judge.feed_all(new))
            return result

        def _refused(self) -> None:
            """End the run if the adapter has refused (its optional ``refusal``, ``adapter.py``):
            what it does from there on is not the spec's to judge. Ends the search
            (``RunRefused``), counted in the coverage; while an earlier failure is being
            shrunk, the candidate is rejected instead."""
            refusal = getattr(self.engine, "refusal", None)
            if refusal is None:
                return
            if tally.failure is not None:
                reject()
            tally.coverage.refused_runs += 1  # not the run's: it may end before its judge
            tally.refusal = str(refusal)
            raise RunRefused(str(refusal))

        def _raise_if(self, finding: Finding | None) -> None:
            if finding is None:
                return
            self._record(finding)
            raise CounterexampleFound(finding)

        def _record(self, finding: Finding, drain: bool = True) -> None:
            """The run so far as the cell's failure (and ``tally.best``, the fewest steps yet)."""
            if tally.first_failure_at is None:
                tally.first_failure_at = time.monotonic() - tally.started
                tally.first_failure_length = len(self.program)
            program = list(self.program)
            if drain:
                self._drain()
            events = list(self.engine.events)
            consequence = consequence_of(finding, self.config, events, self.snapshots)
            named = named_invariant(finding, consequence)
            if tally.target is None:
                tally.target = named
            elif named != tally.target:  # shrinking keeps the property first named
                reject()
            tally.failure = Failure(
                finding, self.config, program, events, consequence, list(self.snapshots)
            )
            if tally.best is None or len(program) <= len(tally.best.program):
                tally.best = tally.failure

        def _drain(self) -> None:
            """Run the engine on (with its default choices) until idle, so that the event file
            also holds the executions of the steps in flight: a replay on tensors then performs
            the reads the finding is about. The judged prefix of the events is unchanged."""
            self.choices.attach(None)
            try:
                for _ in range(500):
                    if not self.engine.step():
                        break
            except Exception:  # the finding stands; a crashed engine just stops the tail
                pass

    class LockstepMachine(LockstepRun, RuleBasedStateMachine):
        """The same run as a Hypothesis state machine (its ``TestCase`` for HypoFuzz and
        ``run_state_machine_as_test``): one initialize rule, one rule, one invariant."""

        run_class = LockstepRun
        """The plain class ``lockstep_test`` instantiates (no state-machine set-up per run)."""

        @initialize(data=st.data())
        def configure(self, data: Any) -> None:
            """The stateful runner's start of a run: ``setup``, drawing from ``data``."""
            self.setup(_draw_integer(data))

        @rule(data=st.data())
        def act(self, data: Any) -> None:
            """One action of the workload (the stateful runner's one rule, always enabled): an
            action choice, then ``perform``."""
            draw = _draw_integer(data)
            slot = draw(0, len(self.mix) - 1)
            self.perform(slot, draw, slot != 0)

        @invariant()
        def observables_agree(self) -> None:
            self.agree()

    target = "" if factory is reference else f"{getattr(factory, '__name__', 'target')}:"
    LockstepMachine.__name__ = f"Lockstep[{target}{_cell_tag(cell)}]"
    LockstepMachine.tally = tally  # type: ignore[attr-defined]
    return LockstepMachine


ACTION_LABEL = 0x69FB_7E1A_6404_1D62
"""The label of the span around one action in the choice sequence: any fixed integer (this is
the first 8 bytes of the SHA-256 of "kvspec lockstep action", as it was first computed)."""


def _spans_available() -> bool:
    """Whether this Hypothesis's choice sequence has the span and boolean calls the lockstep
    driver uses (``ConjectureData.start_span``, ``stop_span``, ``draw_integer``)."""
    try:
        from hypothesis.internal.conjecture.data import ConjectureData
    except ImportError:
        return False
    return all(hasattr(ConjectureData, n) for n in ("start_span", "stop_span", "draw_integer"))


class BudgetSpent(KeyboardInterrupt):
    """Raised by ``lockstep_test`` before an example once ``spent()`` says so, ending the batch
    (``run_cell`` catches it). A ``KeyboardInterrupt``: the one exception Hypothesis lets through
    without recording the example (an example that stopped drawing where an earlier one went on
    would be reported as flaky data generation) and without reporting or shrinking it. Once a
    failure has been found, raised only under ``run_cell(bounded=True)`` (otherwise its shrinking
    runs to the end)."""


def lockstep_test(
    machine: type[RuleBasedStateMachine],
    config: settings,
    digest: bytes = b"",
    spent: Callable[[], bool] | None = None,
) -> Callable[[], None]:
    """The test function that runs ``machine`` (a ``lockstep_machine`` class) under ``config``:
    one example is one run, as under ``get_state_machine_test``, but driven here, on an instance
    of the machine's plain ``run_class`` (no state-machine set-up per run).

    It calls ``setup`` (the run's configuration, each field one integer choice), then runs
    actions: before each, a span is opened and one integer choice made, from 0 to ``ACTIONS``:
    ``STOP`` ends the run (forced after ``stateful_step_count - 1`` actions, as Hypothesis's own
    stateful runner forces its "stop" boolean, the initialize step counted), with ``run_out``
    (under the vLLM discipline, the engine runs until idle) and ``agree``; any other value is the
    kind of the action (a slot of the run's mix, replaced by the next kind that can do something
    unless the value is ``SIMPLEST``), which ``perform`` runs, drawing its own parameters; then
    ``agree`` (the snapshot comparison); ``teardown`` always. (The state machine's own runs, under
    HypoFuzz or ``run_state_machine_as_test``, end where their last rule left them.) So the shrinker
    deletes whole actions (a span: the action's choice and its own) as it does in a state
    machine, one choice per action is saved against the stateful runner's stop boolean and rule
    choice, and none of its per-step work is done (choosing a rule, drawing a fresh
    ``st.data()``, printing support, timing). ``digest`` keys the example database (the key is
    computed here once, not by Hypothesis on every call). ``spent``, when given, is asked before
    each example: once it answers True, ``BudgetSpent`` ends the batch. Where this Hypothesis
    lacks the span calls, the machine runs through ``get_state_machine_test`` instead."""
    if not _spans_available():
        return get_state_machine_test(machine, settings=config)
    actions = max(0, config.stateful_step_count - 1)
    run_class = getattr(machine, "run_class", machine)

    @config
    @given(st.data())
    def run_lockstep(data: Any) -> None:
        choices = data.conjecture_data
        draw_integer = choices.draw_integer
        if spent is not None and spent():
            raise BudgetSpent
        draw = _draw_integer(data)
        run: Any = run_class()
        try:
            run.setup(draw)
            run.agree()
            done = 0
            while True:
                choices.start_span(ACTION_LABEL)
                action = draw_integer(0, ACTIONS, forced=STOP if done >= actions else None)
                if action == STOP:
                    choices.stop_span()
                    run.run_out(draw)
                    run.agree()
                    break
                done += 1
                slot = (action - 1) // SLOT_VALUES
                run.perform(slot, draw, action != SIMPLEST)
                run.agree()
                choices.stop_span()
        finally:
            run.teardown()

    inner = run_lockstep.hypothesis.inner_test  # type: ignore[attr-defined]
    inner._hypothesis_internal_add_digest = digest
    # The database key Hypothesis would compute on every call (hashing the source), once.
    key = function_digest(inner)
    run_lockstep._hypothesis_internal_database_key = key  # type: ignore[attr-defined]
    return run_lockstep


def _timing_tag(async_scheduling: bool | None, stale_output: str | None) -> str:
    """'' for the synchronous drop cell, else e.g. 'async,deliver' ('?' where drawn)."""
    if async_scheduling is False and stale_output == "drop":
        return ""
    overlap = {True: "async", False: "sync", None: "async?"}[async_scheduling]
    return f"{overlap},{stale_output or 'stale?'}"


_TAGGED = ("policy", "discipline", "preemption", "depth", "async_scheduling", "stale_output")
_TAGS = {
    "loads": lambda value: ",loads",
    "prefix_caching": lambda value: ",no-caching",
    "spec_tokens": lambda value: f",drafts={value}",
    "sliding_window": lambda value: f",window={value}",
}


def _cell_tag(cell: Cell) -> str:
    """The machine's name for ``cell`` (Hypothesis's database key): policy, discipline,
    preemption, depth ('D': drawn), timing (``_timing_tag``), then each other field at a value
    other than its default (``,name=value`` for a field with no short tag of its own)."""
    timing = _timing_tag(cell.async_scheduling, cell.stale_output)
    tag = f"{cell.policy},{cell.discipline},{cell.preemption},{cell.depth or 'D'}"
    tag += f",{timing}" if timing else ""
    for f in fields(cell):
        value = getattr(cell, f.name)
        if f.name in _TAGGED or value == f.default:
            continue
        tag += _TAGS[f.name](value) if f.name in _TAGS else f",{f.name}={value}"
    return tag


@dataclass
class CellResult(OfCell):
    """What fuzzing one cell found: its ``cell`` (whose fields it answers for too:
    ``result.policy``), the failure if any and how the search went."""

    cell: Cell
    failure: Failure | None
    seconds_to_failure: float | None
    unshrunk_length: int | None
    seconds: float
    runs: int
    commits: int
    lost_hits: int
    steps_per_run: list[int] = field(default_factory=list)
    """Engine steps (commits) of each run."""
    coverage: Coverage = field(default_factory=Coverage)
    """The rare situations the runs reached (``fuzz_coverage.py``)."""
    stopped: str | None = None
    """Why the failure is not shrunk to the end, when it is not: ``"hung"`` (an engine call
    did not return, ``watchdog.py``), ``"budget"`` (shrinking reached the budget),
    ``"interrupted"`` (Ctrl-C)."""
    refusal: str | None = None
    """The adapter's refusal, seen mid-run, that ended the search (``RunRefused``), or None."""

    @property
    def lost_hits_per_1000_steps(self) -> float:
        return 1000.0 * self.lost_hits / self.commits if self.commits else 0.0


BATCH = 10
"""``run_cell``'s examples per batch. Batches of 100 were tried: they spread Hypothesis's fixed
cost per batch, but its first examples of a batch (a tenth of them, ten of 100) are capped at five
times the length of their simplest extension, which stops at once (``STOP``), so they overrun
after a few actions; runs got shorter and engine steps fewer. With ``STOP`` the simplest value,
the fixed cost of a batch (its simplest example) is small anyway. (Any integer literal of 100 or
more in kvspec's source becomes a value Hypothesis draws 5% of the time for a choice whose range
holds it, from a checkout: an installed wheel's modules are not scanned. Adding one changes
every seeded search.)"""


def coverage_of(config: Config) -> RunCoverage:
    """A run's coverage counters: with several KV-cache groups, their hybrid paths too, read
    from the engine's events (``fuzz_coverage.RunCoverage``'s ``kinds`` and ``sizes``)."""
    if len(config.groups) < 2:
        return RunCoverage()
    return RunCoverage(
        tuple(g.kind for g in config.groups), tuple(g.block_size for g in config.groups)
    )


def run_cell(
    policy: str,
    discipline: str = "vllm",
    preemption: str = "fcfs",
    depth: int | None = None,
    loads: bool = False,
    seconds: float = 10.0,
    seed_value: int = 0,
    chunk: int = BATCH,
    steps: int = 40,
    invariants: Collection[str] | None = None,
    factory: Factory = reference,
    async_scheduling: bool | None = False,
    stale_output: str | None = "drop",
    prefix_caching: bool = True,
    database: ExampleDatabase | None = None,
    shrink: bool = True,
    engine: str = "fast",
    bounded: bool = False,
    **other_fields: Any,
) -> CellResult:
    """``fuzz_cell`` of the cell these fields make (``other_fields``: the ``Cell``'s other fields,
    e.g. ``spec_tokens``, ``sliding_window``), the spelling the tests and benches use."""
    cell = _cell_of(locals())
    return fuzz_cell(
        cell,
        seconds,
        seed_value,
        chunk=chunk,
        steps=steps,
        invariants=invariants,
        factory=factory,
        database=database,
        shrink=shrink,
        engine=engine,
        bounded=bounded,
    )


def fuzz_cell(
    cell: Cell,
    seconds: float = 10.0,
    seed_value: int = 0,
    *,
    invariants: Collection[str] | None = None,
    factory: Factory = reference,
    database: ExampleDatabase | None = None,
    shrink: bool = True,
    engine: str = "fast",
    bounded: bool = False,
    chunk: int = BATCH,
    steps: int = 40,
) -> CellResult:
    """Fuzz one cell until a counterexample is found (and shrunk, unless ``shrink`` is False)
    or ``seconds`` run out.

    Runs batches of ``chunk`` examples, each batch seeded ``seed_value + batch``, so a run is
    reproducible from its seed (``database``: Hypothesis's example database, whose saved
    failures are tried first; default none; with one, batches are not seeded, since Hypothesis
    uses no database under an explicit seed). A batch in which no example could run (the engine
    refused every configuration) ends the search: ``runs`` then says how many ran. A batch also
    ends, before its next example, once ``seconds`` are spent (``BudgetSpent``; never while a
    failure is shrunk), so the budget holds whatever ``chunk`` is. ``engine``: how the runs are
    judged (``run_judge``). Each Hypothesis setting, and why: docs/fuzzing.md.

    ``bounded`` (``kvspec fuzz``): ``seconds`` bounds the whole cell, shrinking included (cut
    short, the failing run with the fewest steps so far is reported, ``stopped``), and every
    engine call is watched (``watchdog.py``: a call still under way ``GRACE`` seconds past the
    budget is an ``EngineHung`` finding, unshrunk). Ctrl-C while a failure is being shrunk
    reports the best one so far the same way; before any, it propagates.

    The batches run one test function, re-seeded (``seed`` sets an attribute of the function),
    not one built per batch: building it hashes the machine's source (Hypothesis's database key),
    which took more than a tenth of a short run's time."""
    machine = cell_machine(cell, invariants, factory, engine)
    tally: Tally = machine.tally  # type: ignore[attr-defined]
    config = settings(
        max_examples=chunk,
        stateful_step_count=steps,
        deadline=None,
        database=database,
        verbosity=Verbosity.quiet,
        phases=((Phase.reuse,) if database is not None else ())
        + (Phase.generate,)
        + ((Phase.shrink,) if shrink else ()),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    batch = 0
    digest = repr((machine.__name__, sorted(invariants or ()), engine)).encode()

    def spent() -> bool:
        searching = tally.first_failure_at is None
        return (searching or bounded) and time.monotonic() - tally.started >= seconds

    test = lockstep_test(machine, config, digest, spent)
    stopped = None
    with watchdog.watching(tally.started + seconds if bounded else None):
        while not spent():
            if database is None:  # Hypothesis uses no database under an explicit seed
                test = seed(seed_value * 1_000_003 + batch)(test)
            batch += 1
            try:
                test()
            except (CounterexampleFound, Unsatisfiable, RunRefused):
                break
            except AdapterMistake as err:  # --check-protocol: bad input, not a counterexample
                raise ProtocolError(str(err)) from None
            except KeyboardInterrupt as stop:  # BudgetSpent, EngineHung, Ctrl-C
                if tally.failure is not None:
                    stopped = _stopped(stop)
                    if stopped != "hung":
                        tally.failure = tally.best
                elif not isinstance(stop, BudgetSpent):
                    raise
                break
    return CellResult(
        cell=cell,
        failure=tally.failure,
        seconds_to_failure=tally.first_failure_at,
        unshrunk_length=tally.first_failure_length,
        seconds=time.monotonic() - tally.started,
        runs=tally.runs,
        commits=tally.commits,
        lost_hits=tally.lost_hits,
        steps_per_run=tally.steps_per_run,
        coverage=tally.coverage,
        stopped=stopped,
        refusal=tally.refusal,
    )


def _stopped(stop: KeyboardInterrupt) -> str:
    """``CellResult.stopped`` for what ended the batch while a failure was being shrunk."""
    if isinstance(stop, watchdog.EngineHung):
        return "hung"
    return "budget" if isinstance(stop, BudgetSpent) else "interrupted"
