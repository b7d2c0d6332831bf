"""``kvspec fuzz --groups``: random runs of the reference engine with several KV-cache groups,
each read and each hit judged by the invariants of docs/hybrid.md.

Until the spec models groups (issue #36, h-groups' branch) there is no lockstep partner for a
hybrid engine, so this fuzzer judges the reference engine's own run: every read a step makes
is checked by the fake device memory (``reference.memory``: ``NoUnwrittenRead``,
``NoUnwrittenStateRead``, ``StateAtItsBoundary``, ``NoReadOfRecycled``), and every admission's
per-group ``hit`` events by ``HitServedByEveryGroup`` (one length, each group's slots for it
present). Runs are drawn from ``--seed`` alone (run ``i`` of seed ``s`` is the same run
everywhere), workloads share prefixes (and half the time whole prompts) across requests in a
pool small enough to preempt, and
the coverage line says what the hybrid paths reached.

``parse_groups`` reads the flag's syntax, ``KIND[:WINDOW][@BLOCK_SIZE]`` comma separated (e.g.
``full,window:8,state`` or ``full@2,state@4``): an unknown kind, a window on a group that is
not ``window`` (or none on one that is), a size that is not an int in 1..65536, or one full or
window group alone (today's model, fuzzed in lockstep without the flag) is bad input, said in
one line. The hash block size is the gcd of the sizes given (every group without one
takes it), or drawn per run when none is.
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

SYNTAX = "KIND[:WINDOW][@BLOCK_SIZE],... (KIND full, window or state; e.g. full,window:8,state)"

GroupText = tuple[str, "int | None", "int | None"]
"""(kind, block size or None for the hash block size, window or None)."""

MAX_LENGTH = 8
"""A request's prompt and output tokens are at most this many times the groups' common block
size: a shared prefix of 1..4 of them, a suffix and an output of 1..2 each."""

NAMES = (
    "HitServedByEveryGroup",
    "StateAtItsBoundary",
    "NoUnwrittenStateRead",
    "NoReadOfRecycled",
    "NoUnwrittenRead",
)
"""The invariants a run is judged by (docs/hybrid.md's table, and the K/V one they extend)."""


def parse_groups(text: str) -> tuple[tuple[str, int | None, int | None], ...]:
    """The groups ``--groups`` names; ValueError with the reason for anything else."""
    out = []
    for i, part in enumerate(text.split(",")):
        part = part.strip()
        where = f"group {i} ({part!r})" if part else f"group {i}"
        spec, _, size_text = part.partition("@")
        kind, _, window_text = spec.partition(":")
        if kind not in ("full", "window", "state"):
            raise ValueError(f"{where}: the kind is full, window or state; syntax {SYNTAX}")
        size = _positive(size_text, where, "block size") if size_text else None
        window = _positive(window_text, where, "window") if window_text else None
        if (kind == "window") != (window is not None):
            raise ValueError(f"{where}: a window group, and only one, names its window (window:W)")
        out.append((kind, size, window))
    if len(out) == 1 and out[0][0] != "state":
        raise ValueError(
            "one full or window group is today's model: fuzz it without --groups "
            "(--sliding-window W for a window), in lockstep with the spec"
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


def engine_groups(
    parsed: tuple[tuple[str, int | None, int | None], ...], hash_size: int
) -> tuple[GroupSpec, ...]:
    """The engine's groups: a group without a block size takes the hash block size."""
    return tuple(GroupSpec(kind, size or hash_size, window) for kind, size, window in parsed)


def hash_block_size(
    parsed: tuple[tuple[str, int | None, int | None], ...], rng: random.Random
) -> int:
    """The gcd of the block sizes given, or drawn from 1..3 when none is."""
    sizes = [s for _, s, _ in parsed if s is not None]
    return math.gcd(*sizes) if sizes else rng.choice((1, 2, 3))


def run_groups_cell(
    parsed: tuple[tuple[str, int | None, int | None], ...],
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
    """Runs until a finding, ``seconds`` or ``max_runs``; with ``stop_on``, only a finding of
    one of those invariants stops (a run that breaks another is abandoned at it)."""
    result = GroupsResult()
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
        finding, steps, coverage = _one_run(
            config, random.Random(f"{seed}:{run}:w"), run, began, stop_on
        )
        result.runs += 1
        result.steps += steps
        result.coverage.add(coverage)
        if finding is not None:
            result.finding = finding
            break
        run += 1
    result.seconds = time.monotonic() - began
    return result


def _one_run(
    config: EngineConfig,
    rng: random.Random,
    run: int,
    began: float,
    stop_on: Collection[str] | None = None,
) -> tuple[GroupsFinding | None, int, RunCoverage]:
    engine = Engine(config, RandomChoices(rng.randrange(1 << 30)))
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

    def found(name: str, detail: str) -> GroupsFinding | None:
        if stop_on is not None and name not in stop_on:
            return None
        seconds = time.monotonic() - began
        return GroupsFinding(name, detail, seconds, run, config, steps, engine.events)

    for _ in range(400):
        move = rng.random()
        if rid < arrivals and (move < 0.3 or not engine.has_unfinished()):
            suffix = rng.choice(suffixes) if rng.random() < 0.5 else suffixes[0][:0]
            suffix = suffix or tuple(
                rng.randrange(config.vocab) for _ in range(rng.randint(1, 2 * align))
            )
            prompt = rng.choice(prefixes) + suffix
            engine.add_request(rid, prompt, rng.randint(1, 2 * align), rng.randrange(3))
            rid += 1
        elif move < 0.33 and rid:
            engine.abort(rng.randrange(rid))
        else:
            try:
                moved = engine.step()
            except (RuntimeError, AssertionError, IndexError, KeyError) as err:
                return found("EngineError", f"{type(err).__name__}: {err}"), steps, coverage
            steps += 1
            if not moved and rid >= arrivals:
                break
        events = engine.events[seen:]
        seen = len(engine.events)
        coverage.observe(events)
        # in the order they happen within one engine call: reads run before the commit
        for b in engine.bad_reads[read:]:
            what = "state" if config.groups[b.group].kind == "state" else "K/V"
            detail = (
                f"step {b.step}: request {b.rid} read the {what} of group {b.group} in block "
                f"{b.block} at position {b.position}"
            )
            if finding := found(b.invariant, detail):
                return finding, steps, coverage
        bad = _hit_fault(config, events, hits)
        if bad is not None and (finding := found("HitServedByEveryGroup", bad)):
            return finding, steps, coverage
        bad = _published_fault(engine, events, published)
        if bad is not None and (finding := found("StateAtItsBoundary", bad)):
            return finding, steps, coverage
        read = len(engine.bad_reads)
    if isinstance(engine.kv, GroupedKV):
        coverage.hits_shortened += engine.kv.n_shortened
    return None, steps, coverage


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
        lengths = {len(b) * g.block_size for b, g in zip(got, groups, strict=True)}
        if len(lengths) != 1:
            return f"request {rid}'s groups hit different lengths {sorted(lengths)}"
        (length,) = lengths
        for g, (spec, blocks_g) in enumerate(zip(groups, got, strict=True)):
            if spec.kind == "full":
                need = range(len(blocks_g))
            elif spec.kind == "window":
                assert spec.window is not None
                need = range(max(0, length - spec.window + 1) // spec.block_size, len(blocks_g))
            else:
                need = range(max(0, len(blocks_g) - 1), len(blocks_g))
            if any(blocks_g[i] == 0 for i in need):
                return (
                    f"request {rid}'s hit of {length} tokens: group {g} ({spec.kind}) lacks a block"
                )
    return None
