"""Readable text for events and counterexamples, and the event file format.

Event files are JSON Lines: a header object, then one JSON array per event exactly as the engine
emitted it (tuples become arrays). The header records the configuration, so a file can be judged
again on its own. (Issue #4 turns this into the documented trace format.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

import orjson

from kvspec.spec import Config
from kvspec.spec.events import EFFECTS

from .lockstep import Event, Finding

FORMAT = "kvspec-events"
VERSION = 0


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
        case "preempt", (rid,):
            return f"preempt r{rid}"
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
    return repr(event)


def format_counterexample(
    program: Sequence[tuple[str, list[Event]]], finding: Finding, config: Config
) -> str:
    """The counterexample as a numbered list of workload steps, each with the engine's decisions
    and their effects, ending with the violated invariant and what it guards."""
    lines = [
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
    return "\n".join(lines)


def write_events(path: str | Path, config: Config, events: Iterable[Event]) -> int:
    """Write an event file; return the number of events written."""
    count = 0
    with open(path, "wb") as out:
        header = {"format": FORMAT, "version": VERSION, "config": asdict(config)}
        out.write(orjson.dumps(header) + b"\n")
        for event in events:
            out.write(orjson.dumps(event) + b"\n")
            count += 1
    return count


def read_events(path: str | Path) -> tuple[Config, list[Event]]:
    """Read an event file back; raise ``ValueError`` naming file:line on malformed input (the
    v1 rules, ``eventfile.py``)."""
    from .eventfile import read_events as read

    return read(path)
