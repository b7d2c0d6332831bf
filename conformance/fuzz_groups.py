"""``kvspec fuzz --groups``: random runs of the reference engine with several KV-cache groups,
judged by the spec in lockstep and by the engine's own checks, every finding named by its
invariant.

``SpecJudge`` applies each engine decision to the spec (``Config.groups``): the spec's effects
must be the engine's, and the spec's invariants (the hybrid ones of docs/hybrid.md among them)
hold after each. When the engine disagrees with the spec, the run goes on judged by the
engine's own checks, which name what the engine's path breaks: every read a step makes, by the
fake device memory (``reference.memory``: ``NoUnwrittenRead``, ``NoUnwrittenStateRead``,
``StateAtItsBoundary``, ``NoReadOfRecycled``), every admission's per-group ``hit`` events by
``HitServedByEveryGroup`` (one length, each group's slots for it present), every registered
state by ``StateAtItsBoundary`` once no step in flight writes it, every published or hit block
of a cross group by ``CrossBlocksPrivate`` (with a cross group half the requests carry encoder
tokens); a disagreement they do not name is reported as ``Disagreement``. Only running requests are aborted (the spec at h-groups'
471bfc7 raises on the abort of a request without group tables); a run whose spec judge raises
is judged by the engine's checks alone (``GroupsResult.spec_errors``). Runs are drawn from ``--seed`` alone (run ``i`` of seed ``s`` is the same run
everywhere), workloads share prefixes (and half the time whole prompts) across requests in a
pool small enough to preempt, and
the coverage line says what the hybrid paths reached.

``parse_groups`` reads the flag's syntax, ``KIND[:WINDOW|:RULE|:CHUNK][@BLOCK_SIZE]`` comma
separated (e.g. ``full,window:8,state``, ``full@2,state:when-known@4`` or ``full,chunked:8``; a
state group's ``RULE`` is its registration rule, ``at-its-step`` by default or ``when-known``,
vLLM's ``align`` timing, ``docs/model.md``; a chunked group's ``CHUNK`` is its attention chunk,
a multiple of its block size): an unknown kind or rule, a window on a group that is not
``window`` (or none on one that is), a chunk missing or not a multiple of the group's block
size, a size that is not an int in 1..65536, or one full or window group alone (today's model,
fuzzed in lockstep without the flag) is bad input, said in one line. The hash block size is the
gcd of the sizes given (every group without one takes it), or drawn per run when none is (from
those that divide every chunk).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from kvspec.conformance.fuzz_coverage import Coverage, RunCoverage
from kvspec.reference import Engine, EngineConfig, GroupSpec, RandomChoices
from kvspec.reference.groups import GroupedKV
from kvspec.spec import OBSERVED_POLICIES, Config, Illegal, apply, check, initial_state
from kvspec.spec.events import DECISIONS
from kvspec.spec.state import Group

SYNTAX = (
    "KIND[:WINDOW|:RULE|:CHUNK][@BLOCK_SIZE],... (KIND full, window, state, cross, chunked or "
    "slot; RULE a state's at-its-step or when-known, CHUNK a chunked group's attention chunk; "
    "e.g. full,window:8,state:when-known, full,cross@4, full,chunked:8 or full,slot with "
    "--policy engine-registers)"
)
KINDS = ("full", "window", "state", "cross", "chunked", "slot")
"""The group kinds ``--groups`` takes: every kind the reference engine follows."""

RULES = ("at-its-step", "when-known")
"""A state group's registration rules (the reference engine's ``STATE_REGISTRATIONS``)."""

GroupText = tuple[str, "int | None", "int | str | None"]
"""(kind, block size or None for the hash block size, what follows the colon or None: a
window group's window, a state group's registration rule, a chunked group's chunk)."""

MAX_LENGTH = 8
"""A request's prompt and output tokens are at most this many times the groups' common block
size: a shared prefix of 1..4 of them, a suffix and an output of 1..2 each."""

MAX_ENCODER = 4
"""With a cross group, half the requests carry 1 .. this many times the common block size
encoder tokens (within ``MAX_LENGTH``: the pool fits any request), the others none."""

NAMES = (
    "CrossBlocksPrivate",
    "TableMatchesComputed",
    "HitServedByEveryGroup",
    "StateAtItsBoundary",
    "NoUnwrittenStateRead",
    "NoReadOfRecycled",
    "NoUnwrittenRead",
)
"""The invariants a run is judged by (docs/hybrid.md's table, and the K/V one they extend)."""


def parse_groups(text: str) -> tuple[GroupText, ...]:
    """The groups ``--groups`` names; ValueError with the reason for anything else."""
    out: list[GroupText] = []
    for i, part in enumerate(text.split(",")):
        part = part.strip()
        where = f"group {i} ({part!r})" if part else f"group {i}"
        spec, _, size_text = part.partition("@")
        kind, _, window_text = spec.partition(":")
        if kind not in KINDS:
            raise ValueError(f"{where}: the kind is {', '.join(KINDS)}; syntax {SYNTAX}")
        size = _positive(size_text, where, "block size") if size_text else None
        if kind in ("cross", "slot") and (window_text or i == 0):
            raise ValueError(f"{where}: a {kind} group takes no :VALUE and is never group 0")
        if kind == "state" and window_text:
            if window_text not in RULES:
                raise ValueError(
                    f"{where}: a state's rule is {' or '.join(RULES)}; syntax {SYNTAX}"
                )
            out.append((kind, size, window_text))
            continue
        if kind == "chunked":
            if not window_text:
                raise ValueError(f"{where}: a chunked group names its chunk (chunked:C)")
            out.append((kind, size, _positive(window_text, where, "chunk")))
            continue
        window = _positive(window_text, where, "window") if window_text else None
        if (kind == "window") != (window is not None):
            raise ValueError(f"{where}: a window group, and only one, names its window (window:W)")
        out.append((kind, size, window))
    if len(out) == 1 and out[0][0] in ("full", "window"):
        raise ValueError(
            "one full or window group is today's model: fuzz it without --groups "
            "(--sliding-window W for a window), in lockstep with the spec"
        )
    sizes = [s for _, s, _ in out if s is not None]
    common = math.gcd(*sizes) if sizes else None
    for i, (kind, size, chunk) in enumerate(out):
        block = size or common
        if kind == "chunked" and block and isinstance(chunk, int) and chunk % block:
            raise ValueError(
                f"group {i}: a chunked group's chunk ({chunk}) is not a multiple of its block size "
                f"({block})"
            )
    return tuple(out)


def _positive(text: str, where: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or value > 1 << 16:
        raise ValueError(f"{where}: the {what} must be an int in 1..65536, got {text!r}")
    return value


@dataclass
class GroupsFinding:
    """The first wrong read or hit of a run."""

    invariant: str
    detail: str
    seconds: float
    run: int
    config: EngineConfig
    steps: int
    events: list[tuple[object, ...]]
    """The run's events up to the finding (the engine's, docs/hybrid.md)."""


@dataclass
class GroupsResult:
    runs: int = 0
    steps: int = 0
    seconds: float = 0.0
    coverage: Coverage = field(default_factory=Coverage)
    finding: GroupsFinding | None = None
    spec_errors: int = 0
    """Runs whose spec judge raised (not ``Illegal``): judged by the engine's checks alone
    from there on."""


def engine_groups(parsed: tuple[GroupText, ...], hash_size: int) -> tuple[GroupSpec, ...]:
    """The engine's groups: a group without a block size takes the hash block size."""
    return tuple(
        GroupSpec(
            kind,
            size or hash_size,
            after if kind == "window" and isinstance(after, int) else None,
            after if isinstance(after, str) else None,
            after if kind == "chunked" and isinstance(after, int) else None,
        )
        for kind, size, after in parsed
    )


def hash_block_size(parsed: tuple[GroupText, ...], rng: random.Random) -> int:
    """The gcd of the block sizes given, or drawn from those of 1..3 that divide every chunked
    group's chunk when none is."""
    sizes = [s for _, s, _ in parsed if s is not None]
    if sizes:
        return math.gcd(*sizes)
    chunks = [c for kind, _, c in parsed if kind == "chunked" and isinstance(c, int)]
    return rng.choice(tuple(b for b in (1, 2, 3) if all(c % b == 0 for c in chunks)))


def run_groups_cell(
    parsed: tuple[GroupText, ...],
    policy: str,
    discipline: str = "vllm",
    preemption: str = "fcfs",
    depth: int | None = None,
    async_scheduling: bool = False,
    stale_output: str = "drop",
    prefix_caching: bool = True,
    seconds: float = 60.0,
    seed: int = 0,
    max_runs: int | None = None,
    stop_on: Collection[str] | None = None,
) -> GroupsResult:
    """Runs until a finding named by an invariant, ``seconds`` or ``max_runs`` (a
    ``Disagreement`` alone is reported at the end: the spec and the engine part, and no run has
    shown yet which invariant that breaks); with ``stop_on``, only a finding of one of those
    invariants stops (a run that breaks another is abandoned at it)."""
    result = GroupsResult()
    unnamed: GroupsFinding | None = None
    """The first ``Disagreement`` no engine check named: reported if no run names one."""
    began = time.monotonic()
    run = 0
    while (max_runs is None or run < max_runs) and time.monotonic() - began < seconds:
        rng = random.Random(f"{seed}:{run}")
        h = hash_block_size(parsed, rng)
        groups = engine_groups(parsed, h)
        align = math.lcm(h, *(g.block_size for g in groups))
        d = depth or rng.randint(2 if async_scheduling or stale_output == "deliver" else 1, 3)
        longest = MAX_LENGTH * align  # a request's tokens at most (``_one_run``)
        need = sum(-(-longest // g.block_size) for g in groups)
        config = EngineConfig(
            num_blocks=rng.randint(need, 2 * need) + 1,
            block_size=h,
            depth=d,
            policy=policy,
            discipline=discipline,
            preemption=preemption,
            token_budget=rng.choice((align, 2 * align, rng.randint(1, 4 * align))),
            max_running=rng.randint(2, 6),
            vocab=rng.randint(2, 4),
            prefix_caching=prefix_caching,
            async_scheduling=async_scheduling,
            stale_output=stale_output,
            groups=groups,
        )
        finding, steps, coverage, spec_error = _one_run(
            config, random.Random(f"{seed}:{run}:w"), run, began, stop_on
        )
        result.spec_errors += spec_error
        result.runs += 1
        result.steps += steps
        result.coverage.add(coverage)
        if finding is not None and finding.invariant == "Disagreement":
            unnamed = unnamed or finding  # go on: a later run may name what it breaks
        elif finding is not None:
            result.finding = finding
            break
        run += 1
    result.finding = result.finding or unnamed
    result.seconds = time.monotonic() - began
    return result


def _one_run(
    config: EngineConfig,
    rng: random.Random,
    run: int,
    began: float,
    stop_on: Collection[str] | None = None,
) -> tuple[GroupsFinding | None, int, RunCoverage, bool]:
    engine = Engine(config, RandomChoices(rng.randrange(1 << 30)))
    judge: SpecJudge | ObservedJudge | None = (
        ObservedJudge(config) if config.policy in OBSERVED_POLICIES else SpecJudge(config)
    )
    spec_error = False
    coverage = RunCoverage(tuple(g.kind for g in config.groups))
    align = math.lcm(*(g.block_size for g in config.groups))
    prefixes = [
        tuple(rng.randrange(config.vocab) for _ in range(rng.randint(1, 4) * align))
        for _ in range(rng.randint(1, 3))
    ]
    suffixes = [
        tuple(rng.randrange(config.vocab) for _ in range(rng.randint(1, 2 * align)))
        for _ in range(2)
    ]
    arrivals = rng.randint(2, 10)
    seen, steps, rid, read = 0, 0, 0, 0
    hits: dict[int, list[tuple[int, ...]]] = {}
    published: dict[int, tuple[int, tuple[int, int] | None]] = {}

    disagreement: str | None = None
    """The spec's first disagreement with the engine: the run goes on, judged by the engine's
    own checks, to name the invariant the engine's path breaks (its consequence)."""

    def found(name: str, detail: str) -> GroupsFinding | None:
        if stop_on is not None and name not in stop_on:
            return None
        if disagreement is not None and name != "Disagreement":
            detail += f" (the spec disagreed first: {disagreement})"
        seconds = time.monotonic() - began
        return GroupsFinding(name, detail, seconds, run, config, steps, engine.events)

    moved: bool | None = None
    for _ in range(400):
        move = rng.random()
        if rid < arrivals and (move < 0.3 or not engine.has_unfinished()):
            suffix = rng.choice(suffixes) if rng.random() < 0.5 else suffixes[0][:0]
            suffix = suffix or tuple(
                rng.randrange(config.vocab) for _ in range(rng.randint(1, 2 * align))
            )
            prompt = rng.choice(prefixes) + suffix
            max_tokens, priority = rng.randint(1, 2 * align), rng.randrange(3)
            if config.cross:  # (drawn only here: the runs without a cross group stay as they were)
                encoder = rng.choice((0, rng.randint(1, MAX_ENCODER * align)))
                engine.add_request(rid, prompt, max_tokens, priority, encoder=encoder)
            else:
                engine.add_request(rid, prompt, max_tokens, priority)
            rid += 1
        elif move < 0.33 and rid:
            victim = rng.randrange(rid)
            if engine.requests.get(victim) and engine.requests[victim].status != "finished":
                engine.abort(victim)
        else:
            try:
                moved = engine.step()
            except (RuntimeError, AssertionError, IndexError, KeyError) as err:
                return (
                    found("EngineError", f"{type(err).__name__}: {err}"),
                    steps,
                    coverage,
                    spec_error,
                )
            steps += 1
            if not moved and rid >= arrivals:
                break
        events = engine.events[seen:]
        seen = len(engine.events)
        coverage.observe(events)
        if judge is not None:
            try:
                verdict = judge.feed(events, final=moved is False)
            except Exception:  # the spec's own error: judged by the engine's checks from here
                judge, spec_error, verdict = None, True, None
            if verdict is not None and verdict[0] == "Disagreement":
                disagreement, judge = verdict[1], None
            elif verdict is not None and (finding := found(*verdict)):
                return finding, steps, coverage, spec_error
        # in the order they happen within one engine call: reads run before the commit
        for b in engine.bad_reads[read:]:
            what = {"state": "state", "cross": "encoder K/V"}.get(
                config.groups[b.group].kind, "K/V"
            )
            detail = (
                f"step {b.step}: request {b.rid} read the {what} of group {b.group} in block "
                f"{b.block} at position {b.position}"
            )
            if finding := found(b.invariant, detail):
                return finding, steps, coverage, spec_error
        bad = _hit_fault(config, events, hits)
        if bad is not None and (finding := found("HitServedByEveryGroup", bad)):
            return finding, steps, coverage, spec_error
        bad = _cross_fault(config, events) if config.cross else None
        if bad is not None and (finding := found("CrossBlocksPrivate", bad)):
            return finding, steps, coverage, spec_error
        bad = _published_fault(engine, events, published)
        if bad is not None and (finding := found("StateAtItsBoundary", bad)):
            return finding, steps, coverage, spec_error
        read = len(engine.bad_reads)
    if judge is not None:
        try:
            verdict = judge.feed([], final=True)
        except Exception:
            verdict, spec_error = None, True
        if verdict is not None and verdict[0] == "Disagreement":
            disagreement = verdict[1]
        elif verdict is not None and (finding := found(*verdict)):
            return finding, steps, coverage, spec_error
    if disagreement is not None and (finding := found("Disagreement", disagreement)):
        return finding, steps, coverage, spec_error
    if isinstance(engine.kv, GroupedKV):
        coverage.hits_shortened += engine.kv.n_shortened
    return None, steps, coverage, spec_error


def _published_fault(
    engine: Engine,
    events: list[tuple[object, ...]],
    published: dict[int, tuple[int, tuple[int, int] | None]],
) -> str | None:
    """``StateAtItsBoundary`` on the registered states: once no step in flight writes it, a
    registered state block holds the state computed at its boundary of the prefix it was
    registered for (``published``: block -> (request, that state's identity), kept from the
    ``publish``, ``unpublish`` and ``evict`` events)."""
    groups, memory = engine.config.groups, engine.worker.memory  # type: ignore[attr-defined]
    assert memory is not None
    for event in events:
        kind, fields_ = event[0], [x for x in event[1:] if isinstance(x, int)]
        if kind == "publish" and groups[fields_[3] if len(fields_) > 3 else 0].kind == "state":
            rid, slot, block = fields_[:3]
            g = fields_[3] if len(fields_) > 3 else 0
            boundary = (slot + 1) * groups[g].block_size
            published[block] = (rid, memory._content(engine.requests[rid], boundary))
        elif kind in ("unpublish", "evict"):
            published.pop(fields_[0], None)
    if not published:
        return None
    pending = set()
    for step in engine.scheduler.all_steps():
        for entry in step.entries.values():
            for g, spec in enumerate(groups):
                if spec.kind == "state" and entry.tables is not None:
                    pending.add(entry.tables[g][-(-entry.end // spec.block_size) - 1][0])
    blocks = engine.pool.blocks
    for block, (rid, expected) in published.items():
        if block in pending:
            continue
        held = memory.state.get(block)
        if held is None or held[0] != blocks[block].generation:
            what = "nothing written since it was allocated"
        elif held[1] is None:
            what = "garbage (computed from wrong inputs)"
        elif held[1] != expected:
            what = f"the state at {held[1][0]} tokens" + (
                " of another prefix" if expected and held[1][0] == expected[0] else ""
            )
        else:
            continue
        at = str(expected[0]) if expected else "?"
        return (
            f"block {block}, registered for request {rid}'s state at {at} tokens, holds "
            f"{what} once no step in flight writes it"
        )
    return None


def spec_config(config: EngineConfig) -> Config:
    """The spec's ``Config`` of the reference engine's: every field the two share, the groups as
    the spec's ``Group`` (``()``: one group). The lockstep tests of the reference engine use it
    too (``tests/test_reference.py``)."""
    return Config(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        depth=config.depth,
        policy=config.policy,
        discipline=config.discipline,
        preemption=config.preemption,
        token_budget=config.token_budget,
        max_running=config.max_running,
        stop_token=config.stop_token,
        async_scheduling=config.async_scheduling,
        stale_output=config.stale_output,
        prefix_caching=config.prefix_caching,
        spec_tokens=config.spec_tokens,
        delay_load_registration=config.delay_load_registration,
        defer_free=config.defer_free,
        sliding_window=config.sliding_window,
        defer_loads=config.defer_loads,
        groups=tuple(Group(*g) for g in config.groups),
    )


class SpecJudge:
    """The spec in lockstep with one run: each engine decision is applied to the spec, whose
    effects must be the engine's that follow it (else ``Disagreement``), and the spec's
    invariants are checked after each (a violation is named by its invariant)."""

    def __init__(self, config: EngineConfig) -> None:
        self.state = initial_state(spec_config(config))
        self.pending: list[tuple[object, ...]] = []
        """The last decision and the effects seen after it so far."""

    def feed(self, events: list[tuple[object, ...]], final: bool = False) -> tuple[str, str] | None:
        """(invariant or ``Disagreement``, detail) for the first decision judged wrong."""
        self.pending += events
        starts = [i for i, e in enumerate(self.pending) if e[0] in DECISIONS]
        done = starts[1:] + ([len(self.pending)] if final and starts else [])
        for begin, end in zip(starts, done, strict=False):
            decision, emitted = self.pending[begin], self.pending[begin + 1 : end]
            try:
                effects = [tuple(e) for e in apply(self.state, decision)]
            except Illegal as err:
                return "Disagreement", f"the spec finds {decision!r} illegal: {err}"
            if effects != emitted:
                return (
                    "Disagreement",
                    f"after {decision!r} the spec emits {effects!r}, the engine {emitted!r}",
                )
            violation = check(self.state)
            if violation is not None:
                return violation.invariant, f"after {decision!r}: {violation.sentence}"
        if done:
            self.pending = self.pending[done[-1] :]
        return None


class ObservedJudge:
    """``SpecJudge``'s ``feed`` over the spec's observed judge (``Judge.spec(observed=True)``,
    docs/adapters.md, "Judging modes"), for the engine's own registration (``engine-registers``):
    its publishes, its snapshots of slot groups' states and its letting go of window blocks are
    its own effects, judged by their guards and the invariants; an ``Illegal`` effect is a
    ``Disagreement``."""

    def __init__(self, config: EngineConfig) -> None:
        from kvspec.judge import Judge

        self.judge = Judge.spec(spec_config(config), observed=True)

    def feed(self, events: list[tuple[object, ...]], final: bool = False) -> tuple[str, str] | None:
        """(invariant or ``Disagreement``, detail) for the first decision judged wrong."""
        found = self.judge.feed_all(events)
        if found is None and final:
            found = self.judge.settle()
        if found is None:
            return None
        if found.invariant in ("Illegal", "Disagreement"):
            return "Disagreement", found.message
        return found.invariant, found.message


def _hit_fault(
    config: EngineConfig, events: list[tuple[object, ...]], hits: dict[int, list[tuple[int, ...]]]
) -> str | None:
    """``HitServedByEveryGroup`` on each admission's per-group ``hit`` events."""
    groups = config.groups
    for event in events:
        if event[0] != "hit":
            continue
        rid, blocks = event[1], event[2]
        assert isinstance(rid, int) and isinstance(blocks, tuple)
        got = hits.setdefault(rid, [])
        got.append(blocks)
        if len(got) < len(groups):
            continue
        del hits[rid]
        lengths = {
            len(b) * g.block_size
            for b, g in zip(got, groups, strict=True)
            if g.kind not in ("cross", "slot")
        }
        if len(lengths) != 1:
            return f"request {rid}'s groups hit different lengths {sorted(lengths)}"
        (length,) = lengths
        for g, (spec, blocks_g) in enumerate(zip(groups, got, strict=True)):
            if spec.kind == "full":
                need = range(len(blocks_g))
            elif spec.kind == "cross":  # caches nothing: its hit is empty (_cross_fault)
                need = range(0)
            elif spec.kind == "slot":  # one state, at the hit's length, copied into its slot
                if len(blocks_g) != (1 if length else 0):
                    return (
                        f"request {rid}'s hit of {length} tokens: slot group {g} names {blocks_g}"
                    )
                need = range(len(blocks_g))
            elif spec.kind == "window":
                assert spec.window is not None
                need = range(max(0, length - spec.window + 1) // spec.block_size, len(blocks_g))
            elif spec.kind == "chunked":  # the blocks of the chunk of the hit's next token
                assert spec.chunk is not None
                need = range(length // spec.chunk * spec.chunk // spec.block_size, len(blocks_g))
            else:
                need = range(max(0, len(blocks_g) - 1), len(blocks_g))
            if any(blocks_g[i] == 0 for i in need):
                return (
                    f"request {rid}'s hit of {length} tokens: group {g} ({spec.kind}) lacks a block"
                )
    return None


def _cross_fault(config: EngineConfig, events: list[tuple[object, ...]]) -> str | None:
    """``CrossBlocksPrivate`` on the engine's effects: a block of a cross group's table is
    never published nor hit (it holds one request's encoder output)."""
    groups = config.groups
    for event in events:
        if event[0] not in ("publish", "hit"):
            continue
        group = event[-1] if len(event) == (5 if event[0] == "publish" else 4) else 0
        if not isinstance(group, int) or groups[group].kind != "cross":
            continue
        if event[0] == "publish":
            return f"request {event[1]}'s cross block {event[3]} (group {group}) is published"
        if event[2]:
            return f"request {event[1]}'s cross group {group} hit blocks {event[2]}"
    return None
