"""Reports: what a judge found, as data (``Report``), and its renderings as text and JSON; readable
phrases for events and counterexamples.

A ``Report`` is made from a stream judge (``report_of``: the finding's fields, the violating
event and its minimal history from the judge's recorder, the timeline of the involved blocks for
the picture) and rendered separately: ``text`` for a terminal, ``as_dict`` for ``--json`` (fields,
not prose), ``html.write_html`` for the picture. Nothing here parses a message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvspec.judge import Finding, Judge
from kvspec.judge.consequence import Consequence
from kvspec.judge.findings import explanation
from kvspec.spec import Config
from kvspec.spec.events import DECISIONS, EFFECTS, KINDS, blocks_of, request_of, requests_of

Event = tuple[object, ...]


@dataclass
class Report:
    path: str
    exit_code: int
    """0 holds, 1 violation, 2 unreadable."""
    events: int = 0
    seconds: float = 0.0
    error: str | None = None
    """For exit 2: ``file:line: message``."""
    line: int | None = None
    invariant: str | None = None
    message: str | None = None
    explanation: str | None = None
    event: str | None = None
    arose_after: int | None = None
    history: list[tuple[int, str]] = field(default_factory=list)
    history_events: list[tuple[int, Event]] = field(default_factory=list, compare=False)
    """The history's events themselves (``--json`` gives each as its kind and named fields)."""
    timeline: list[tuple[int, int, str, int | None]] = field(default_factory=list)
    """(line, block, what, request) for the picture: the involved blocks' history."""
    note: str | None = field(default=None, compare=False)
    consequence: Consequence | None = field(default=None, compare=False)
    lanes: object = field(default=None, compare=False)
    """The trace's timeline (``trace_events.Timeline``) for the HTML report, where made."""
    observed_hint: str | None = field(default=None, compare=False)
    """A strict finding observed judging would accept: the sentence and the command."""
    """A ``Disagreement``'s consequence: the events judged on past it (``judge/consequence.py``)."""
    """How it was judged, when not as usual: the fast model from source (``fastbuild.py``)."""

    @property
    def status(self) -> str:
        return ("holds", "violation", "unreadable")[self.exit_code]

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "status": self.status,
            "exit": self.exit_code,
            "events": self.events,
            "seconds": round(self.seconds, 3),
        }
        if self.error is not None:
            out["error"] = self.error
        if self.note is not None:
            out["note"] = self.note
        if self.invariant is not None:
            out["violation"] = {
                "line": self.line,
                "where": f"{self.path}:{self.line}",
                "invariant": self.invariant,
                "message": self.message,
                "explanation": self.explanation,
                "event": self.event,
                "arose_after_line": self.arose_after,
                "history": [
                    {"line": ln, "event": text, **event_fields(event)}
                    for (ln, text), (_, event) in zip(
                        self.history,
                        self.history_events or [(ln, ()) for ln, _ in self.history],
                        strict=True,
                    )
                ],
                "safety": None if self.consequence is None else self.consequence.safety,
                "consequence": None if self.consequence is None else self.consequence.as_dict(),
                "observed_accepts": self.observed_hint is not None,
                "observed_hint": self.observed_hint,
            }
        return out

    def text(self) -> str:
        if self.exit_code == 2:
            return self.error or f"{self.path}: unreadable"
        note = "" if self.note is None else f" [note: {self.note}]"
        if self.exit_code == 0:
            return f"{self.path}: holds ({self.events} events, {self.seconds:.2f} s){note}"
        lines = [] if self.consequence is None else [consequence_line(self.consequence)]
        lines += [
            f"{self.path}:{self.line}: {self.invariant}: {self.message}",
            f"  event: {self.event}",
            f"  ({self.explanation})",
        ]
        if self.arose_after is not None:
            lines.append(
                f"  (incremental check: the state was fine at line {self.arose_after}; it broke "
                f"between there and line {self.line})"
            )
        lines.append("  minimal history (events that touched the blocks and requests involved):")
        lines += [f"    {self.path}:{ln}: {text}" for ln, text in self.history]
        if self.observed_hint is not None:
            lines.append(f"  {self.observed_hint}")
        if note:
            lines.append(f" {note}")
        return "\n".join(lines)


def describe(event: Event) -> str:
    """One event as a short phrase."""
    kind, args = event[0], event[1:]
    match kind, args:
        case "arrive", (rid, prompt, max_tokens, priority):
            return f"r{rid} arrives: {len(prompt)} prompt tokens {list(prompt)}, max {max_tokens} new, priority {priority}"
        case "begin", (step,):
            return f"begin step {step}"
        case "schedule", (rid, tokens, 0):
            return f"schedule r{rid} for {tokens} tokens"
        case "schedule", (rid, 0, loaded):
            return f"schedule r{rid} to load {loaded} blocks from the external store"
        case "schedule", (rid, tokens, loaded):
            return f"schedule r{rid} for {tokens} tokens and to load {loaded} blocks"
        case "schedule", (rid, tokens, loaded, bound):  # spec.events.WHEN_SET
            more = f" and to load {loaded} blocks" if loaded else ""
            return f"schedule r{rid} for {tokens} tokens{more}, its hit bounded to {bound} tokens"
        case "preempt", (rid,):
            return f"preempt r{rid}"
        case "trim", (rid,):
            return f"r{rid} gives up the blocks no step reads any more"
        case "submit", (step,):
            return f"submit step {step}"
        case "execute", (step, failed):
            fails = f" (loads of {', '.join(f'r{r}' for r in failed)} FAIL)" if failed else ""
            return f"worker executes step {step}{fails}"
        case "commit", (step, sampled):
            toks = ", ".join(f"r{r}<-{t}" for r, t in sampled)
            return f"commit step {step}" + (f" sampling {toks}" if toks else "")
        case "abort", (rid,):
            return f"abort r{rid}"
        case "reset", ():
            return "reset the prefix cache"
        case "reset", (True,):  # spec.events.WHEN_SET
            return "reset the prefix cache, the running requests preempted in this step"
        case "hit", (rid, blocks):
            return f"r{rid} hits blocks {list(blocks)}"
        case "evict", (block,):
            return f"evict block {block}'s hash"
        case "alloc", (rid, block):
            return f"alloc block {block} to r{rid}"
        case "publish", (rid, index, block):
            return f"publish r{rid}[{index}] as block {block}"
        case "unpublish", (block,):
            return f"unpublish block {block}"
        case "free", (block,):
            return f"free block {block}"
        case "load_failed", (rid,):
            return f"r{rid}'s load failed: it recomputes"
        case "finish", (rid, reason):
            return f"r{rid} finishes ({reason})"
        case "dedup", (rid, index, block):
            return f"r{rid}[{index}] now names the published copy block {block}"
        case "snapshot", (rid, index, block, *group):  # always in a slot group
            where = f" (group {group[0]})" if group else ""
            return f"r{rid}'s state after its block {index} cached in block {block}{where}"
        case "track", (rid, block, tokens, *group):  # always in a slot group
            where = f" (group {group[0]})" if group else ""
            return (
                f"r{rid}'s step also writes its state after {tokens} tokens to block {block}{where}"
            )
    return repr(event)


def format_counterexample(
    program: Sequence[tuple[str, list[Event]]],
    finding: Finding,
    config: Config,
    consequence: Consequence | None = None,
) -> str:
    """The counterexample as a numbered list of workload steps, each with the engine's decisions
    and their effects, ending with the violated invariant and what it guards. A deviation's
    ``consequence`` (``judge/consequence.py``) comes first: what it breaks, or that it breaks
    nothing."""
    lines = [] if consequence is None else [consequence_line(consequence)]
    lines += [
        f"config: {config.num_blocks} blocks of {config.block_size} tokens, depth {config.depth}, "
        f"budget {config.token_budget}, at most {config.max_running} running, "
        f"policy {config.policy}, discipline {config.discipline}, "
        f"preemption {config.preemption}"
    ]
    index = 0  # position in the whole event stream, to stop at the finding
    for number, (action, events) in enumerate(program, 1):
        lines.append(f"{number:3d}. {action}")
        line = ""
        for event in events:
            if index > finding.event:
                break
            text = describe(event) + ("   <== here" if index == finding.event else "")
            index += 1
            if event[0] == "arrive":
                continue
            if event[0] in EFFECTS:
                line += f" -> {text}"
            else:
                if line:
                    lines.append(f"       {line}")
                line = text
        if line:
            lines.append(f"       {line}")
        if index > finding.event:
            break
    lines.append(f"violated: {finding.invariant}: {finding.message}")
    lines.append(f"  ({finding.explanation})")
    if consequence is not None and consequence.invariant is not None:
        lines.append(f"  {consequence.invariant}: {explanation(consequence.invariant)}")
    return "\n".join(lines)


def consequence_line(consequence: Consequence) -> str:
    """A deviation's consequence as the report's first line."""
    if consequence.invariant is not None:
        return f"SAFETY: {consequence.headline()}"
    if consequence.stopped is not None:
        return f"DEVIATION: {consequence.headline()}"
    return f"EFFICIENCY: {consequence.headline()}"


def event_fields(event: Event) -> dict[str, object]:
    """An event as fields: ``{"kind": ..., "fields": {name: value}}`` (``spec/events.py``'s
    names; the checker's own ``wrote`` and ``read``: req, block, step); empty for none."""
    if not event:
        return {}
    kind = str(event[0])
    names: tuple[str, ...]
    if kind in ("wrote", "read"):
        names = ("req", "block", "step")
    elif kind in KINDS:
        names = tuple(name for name, _ in KINDS[kind].fields)
    else:
        return {"kind": kind}
    return {"kind": kind, "fields": dict(zip(names, _plain(event[1:]), strict=False))}


def _plain(values: object) -> list[object]:
    """Tuples as lists, recursively (JSON)."""
    return [_plain(v) if isinstance(v, tuple) else v for v in values]  # type: ignore[attr-defined]


def describe_any(event: Event) -> str:
    """``describe`` plus the checker's own entries (a step's writes and reads of a block)."""
    kind = event[0]
    if kind in ("wrote", "read"):
        _, rid, block, step = event
        verb = "writes" if kind == "wrote" else "reads"
        return f"step {step} {verb} block {block} for r{rid}"
    return describe(event)


def involved(judge: Judge) -> tuple[set[int], set[int]]:
    """(blocks, requests) named by the judge's finding and by the violating event."""
    finding = judge.finding
    if finding is None:
        return set(), set()
    blocks, requests = set(finding.blocks), set(finding.requests)
    if judge.last is not None:
        blocks.update(blocks_of(judge.last))
        requests.update(requests_of(judge.last))
    n = judge.config.num_blocks
    return {b for b in blocks if isinstance(b, int) and 0 <= b < n}, requests


def report_of(judge: Judge, name: str, seconds: float = 0.0, note: str | None = None) -> Report:
    """The report of a stream judge's finding (its recorder gives the minimal history)."""
    finding = judge.finding
    assert finding is not None and judge.recorder is not None
    blocks, requests = involved(judge)
    last = None if judge.last is None else (finding.line or judge.line, judge.last)
    history = judge.recorder.minimal_history(blocks, requests, last)  # type: ignore[attr-defined]
    timeline = []
    for line, event in history:
        kind = str(event[0])
        rid = event[1] if kind in ("wrote", "read") else request_of(event)
        ids: Iterable[object] = (event[2],) if kind in ("wrote", "read") else blocks_of(event)
        for block in ids:
            if block in blocks:
                timeline.append((line, block, kind, rid))  # type: ignore[arg-type]
    return Report(
        name,
        1,
        judge.events_seen,
        seconds,
        line=finding.line,
        invariant=finding.invariant,
        message=finding.message,
        explanation=finding.explanation,
        event=describe_any(judge.last) if judge.last is not None else None,
        arose_after=finding.arose_after,
        history=[(ln, describe_any(e)) for ln, e in history],
        history_events=list(history),
        timeline=timeline,  # type: ignore[arg-type]
        note=note,
    )


def observed_accepts(
    config: Config,
    events: Iterable[Event],
    finding: Finding,
    snapshots: Sequence[tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]] = (),
) -> bool:
    """Whether observed matching (the engine's legal choices of free and hit blocks and its own
    unpublishes accepted: ``docs/adapters.md``) judges ``events`` past the strict judge's first
    ``finding`` without a finding at or before it: the difference is one observed judging
    accepts. ``snapshots``: the engine's (events emitted, (refcounts, free queue)), compared
    where they were taken."""
    judge = Judge.spec(config, observed=True)
    pending = list(snapshots)
    for i, event in enumerate(events):
        while pending and pending[0][0] <= i and judge.finding is None:
            judge.compare(*pending.pop(0)[1])
        if judge.finding is not None or judge.feed(event) is not None:
            break
        if i > finding.event and event[0] in DECISIONS:  # the decision held there is judged
            break
    else:
        judge.settle()
    found = judge.finding
    return found is None or found.event > finding.event


def observed_hint_text() -> str:
    return (
        "observed judging accepts this difference (the engine may order its free and hit "
        "blocks its own way, docs/adapters.md): judge it so with kvspec check --observed"
    )


def observed_hint(
    config: Config,
    events: Sequence[Event],
    finding: Finding,
    judging: str,
    snapshots: Sequence[tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]] = (),
) -> str | None:
    """For a strict run's first finding, a ``Disagreement`` observed judging accepts: the
    sentence that says so and the command (else None)."""
    if judging != "strict" or finding.invariant != "Disagreement":
        return None
    if not observed_accepts(config, events, finding, snapshots):
        return None
    return observed_hint_text()
