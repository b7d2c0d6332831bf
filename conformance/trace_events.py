"""A trace as a timeline in the Chrome trace-event format, which Perfetto (ui.perfetto.dev) and
chrome://tracing open: ``kvspec check --trace-events FILE`` and ``kvspec fuzz --out`` (beside
its trace).

Time is the event's place in the trace (one event = ``TICK`` microseconds), so every event of the
trace has its own instant. Three processes hold the tracks: *steps* (one span per step, from its
``begin`` to its ``commit``), *requests* (one track per request: a span from arrival to finish,
with its schedules, hits, allocations, publishes, preemptions and finish as instant events) and
*blocks* (one track per block: allocated, hit, published, evicted, freed, and, from the spec's
replay plan (``plan.py``), each write of a step marked ``full`` or ``partial`` and each read).
A finding is a global instant event named after its invariant; a read of a block the finding is
about (the witness read of a zombie) is named ``WITNESS read``.

``timeline`` is the data (a list of lanes and marks) the HTML report draws too (``html.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvspec.spec import Config
from kvspec.spec.events import blocks_of, request_of

Event = tuple[object, ...]

TICK = 1000
"""Microseconds per trace event on the timeline."""

STEPS, REQUESTS, BLOCKS = 1, 2, 3
"""The processes (``pid``) of the three kinds of track."""


@dataclass
class Mark:
    """One instant on a lane: at event ``at``, ``name``, what kind (for colours), details."""

    at: int
    name: str
    kind: str
    args: dict[str, object] = field(default_factory=dict)


@dataclass
class Lane:
    """One track: ``pid`` (steps, requests or blocks), its id, its spans (start, end, name) and
    marks."""

    pid: int
    tid: int
    title: str
    spans: list[tuple[int, int, str]] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)


@dataclass
class Timeline:
    lanes: dict[tuple[int, int], Lane]
    length: int
    finding_at: int | None = None
    finding_name: str | None = None
    finding_message: str | None = None


def _lane(lanes: dict[tuple[int, int], Lane], pid: int, tid: int) -> Lane:
    lane = lanes.get((pid, tid))
    if lane is None:
        title = {STEPS: "steps", REQUESTS: f"r{tid}", BLOCKS: f"block {tid}"}[pid]
        lane = lanes[(pid, tid)] = Lane(pid, tid, title)
    return lane


def timeline(
    config: Config,
    events: Sequence[Event],
    finding_at: int | None = None,
    finding_name: str | None = None,
    finding_message: str | None = None,
    finding_blocks: Sequence[int] = (),
    judging: str = "strict",
) -> Timeline:
    """The lanes of ``events`` (up to the end); the finding at event ``finding_at`` marked."""
    lanes: dict[tuple[int, int], Lane] = {}
    begun: dict[object, int] = {}
    arrived: dict[int, int] = {}
    steps = _lane(lanes, STEPS, 0)
    writes = _plan(config, events, judging)
    zombies = set(finding_blocks)
    for i, event in enumerate(events):
        kind = str(event[0])
        rid = request_of(event)
        if kind == "begin":
            begun[event[1]] = i
        elif kind == "commit":
            steps.spans.append((begun.pop(event[1], i), i, f"step {event[1]}"))
        elif kind in ("submit", "execute"):
            steps.marks.append(Mark(i, f"{kind} step {event[1]}", kind))
        if kind == "arrive" and rid is not None:
            arrived[rid] = i
        if rid is not None:
            name = {
                "arrive": "arrive",
                "schedule": f"schedule {event[2]} tokens" if len(event) > 2 else "schedule",
                "preempt": "PREEMPT",
                "abort": "abort",
                "hit": f"hit {list(blocks_of(event))}",
                "alloc": f"alloc block {event[2]}" if len(event) > 2 else "alloc",
                "publish": f"publish [{event[2]}] as block {event[3]}" if len(event) > 3 else kind,
                "finish": f"finish ({event[2]})" if len(event) > 2 else "finish",
                "dedup": "dedup",
                "snapshot": f"snapshot [{event[2]}] to block {event[3]}"
                if len(event) > 3
                else kind,
                "track": f"track {event[3]} tokens to block {event[2]}" if len(event) > 3 else kind,
                "load_failed": "load failed",
            }.get(kind, kind)
            lane = _lane(lanes, REQUESTS, rid)
            lane.marks.append(Mark(i, name, kind))
            if kind == "finish":
                lane.spans.append((arrived.pop(rid, 0), i, f"r{rid}"))
        for block in blocks_of(event):
            if kind == "hit" and block == 0:
                continue
            who = f" r{rid}" if rid is not None else ""
            verb = {
                "alloc": "alloc to",
                "hit": "hit by",
                "publish": "published by",
                "snapshot": "state cached from",
                "track": "state tracked by",
            }.get(kind, kind)
            _lane(lanes, BLOCKS, block).marks.append(Mark(i, f"{verb}{who}", kind))
        for block, mark in writes.get(i, ()):
            if mark.kind == "read" and block in zombies and finding_at is not None:
                mark = Mark(mark.at, f"WITNESS {mark.name}", "witness", mark.args)
            _lane(lanes, BLOCKS, block).marks.append(mark)
    for rid, start in arrived.items():  # still live at the end
        _lane(lanes, REQUESTS, rid).spans.append((start, len(events), f"r{rid} (live)"))
    for step, start in begun.items():
        steps.spans.append((start, len(events), f"step {step} (in flight)"))
    return Timeline(lanes, len(events), finding_at, finding_name, finding_message)


def _plan(
    config: Config, events: Sequence[Event], judging: str
) -> dict[int, list[tuple[int, Mark]]]:
    """Per ``execute`` event, the writes (full or partial) and reads of its step, per the spec's
    replay plan; none where the spec does not accept the trace."""
    from kvspec.impl.paged.records import Executed

    from .plan import PlanError, replay_plan

    try:
        plan = replay_plan(config, events, judging)
    except (PlanError, ValueError):
        return {}
    bsz = config.block_size
    out: dict[int, list[tuple[int, Mark]]] = {}
    for record in plan:
        if not isinstance(record, Executed):
            continue
        marks = out.setdefault(record.event_index, [])
        for work in record.work:
            if work.failed:
                continue
            for index in range(work.start // bsz, -(-work.end // bsz)):
                if index >= len(work.blocks) or work.blocks[index] == 0:
                    continue
                full = work.end >= (index + 1) * bsz
                lo, hi = max(work.start, index * bsz), min(work.end, (index + 1) * bsz)
                what = "full" if full else "partial"
                name = f"write {what} by r{work.req} (step {record.step})"
                args = {
                    "positions": f"{lo}..{hi - 1}",
                    "of": f"{index * bsz}..{(index + 1) * bsz - 1}",
                }
                marks.append(
                    (work.blocks[index], Mark(record.event_index, name, f"write-{what}", args))
                )
            if work.load:
                continue
            for index in range(min(len(work.blocks), -(-work.end // bsz))):
                block = work.blocks[index]
                if block == 0 or index >= work.start // bsz:
                    continue  # its own writes are marked above
                name = f"read by r{work.req} (step {record.step})"
                marks.append((block, Mark(record.event_index, name, "read")))
    return out


def chrome_trace(line: Timeline, name: str = "kvspec") -> dict[str, Any]:
    """The timeline as Chrome trace-event JSON (``{"traceEvents": [...]}``): metadata naming the
    processes and tracks, complete events (``ph: "X"`` with ``dur``) for spans, instant events
    (``ph: "i"``) for marks, a global instant for the finding."""
    out: list[dict[str, Any]] = []
    for pid, title in ((STEPS, "steps"), (REQUESTS, "requests"), (BLOCKS, "blocks")):
        out.append({"ph": "M", "pid": pid, "tid": 0, "ts": 0, "name": "process_name", "args": {"name": title}})  # fmt: skip
        out.append({"ph": "M", "pid": pid, "tid": 0, "ts": 0, "name": "process_sort_index", "args": {"sort_index": pid}})  # fmt: skip
    for (pid, tid), lane in sorted(line.lanes.items()):
        out.append({"ph": "M", "pid": pid, "tid": tid, "ts": 0, "name": "thread_name", "args": {"name": lane.title}})  # fmt: skip
        out.append({"ph": "M", "pid": pid, "tid": tid, "ts": 0, "name": "thread_sort_index", "args": {"sort_index": tid}})  # fmt: skip
        for start, end, title in lane.spans:
            out.append({"ph": "X", "pid": pid, "tid": tid, "ts": start * TICK, "dur": max(1, end - start) * TICK, "name": title, "cat": "span"})  # fmt: skip
        for mark in lane.marks:
            args = {"event": mark.at, **mark.args}
            out.append({"ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": mark.at * TICK, "name": mark.name, "cat": mark.kind, "args": args})  # fmt: skip
    if line.finding_at is not None:
        out.append({"ph": "i", "s": "g", "pid": STEPS, "tid": 0, "ts": line.finding_at * TICK, "name": f"VIOLATION {line.finding_name}", "cat": "violation", "args": {"event": line.finding_at, "message": line.finding_message}})  # fmt: skip
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"source": name}}


def write_chrome_trace(path: str, line: Timeline, name: str = "kvspec") -> None:
    import orjson

    with open(path, "wb") as out:
        out.write(orjson.dumps(chrome_trace(line, name)))


def of_file(path: str, report: Any = None) -> Timeline:
    """The timeline of a trace file; ``report`` (``report.Report``) marks its finding (its line,
    invariant, message and the blocks its history is about)."""
    from .trace import open_trace

    with open_trace(path) as trace:
        config, judging = trace.config, trace.judging
        lines_events = [(line, event) for line, event, _ in trace.events()]
    events = [event for _, event in lines_events]
    at = None
    if report is not None and report.exit_code == 1 and report.line is not None:
        at = next((i for i, (ln, _) in enumerate(lines_events) if ln == report.line), None)
    blocks = sorted({b for _, b, _, _ in report.timeline}) if report is not None else []
    return timeline(
        config,
        events,
        at,
        None if report is None else report.invariant,
        None if report is None else report.message,
        blocks,
        judging,
    )
