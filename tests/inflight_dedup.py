"""A stand-in, for the SGLang adapter's tests only, for a spec change proposed to the lead and not
made here (``spec/`` is the lead's): ``spec/observed.py``'s ``dedup`` refuses a swap while a step in
flight still uses the request's copy, but SGLang's default overlap scheduler makes exactly that
swap, safely (``docs/adapters.md``, "SGLang 0.5.23": the copy keeps its bytes until a batch
launched later overwrites it, after the forward in flight has read it). The proposed rule refuses
the swap only while the step being *built* uses the copy; a submitted step keeps the copy its
entry names and is judged on it as before.

``apply()`` installs the proposed rule in this process when the spec still refuses
(``refuses()``), and does nothing once the spec has the change, so the tests that import it keep
running unchanged after it lands (this file can then go).
"""

from __future__ import annotations

import kvspec.spec.observed as observed
from kvspec.spec import Config, Illegal
from kvspec.spec.pool import Event, release
from kvspec.spec.state import State

SGLANG_EVENTS: tuple[tuple[object, ...], ...] = (
    ("arrive", 0, (3, 1), 1, 0),
    ("begin", 0),
    ("schedule", 0, 2, 0),
    ("hit", 0, ()),
    ("alloc", 0, 1),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ((0, 0),)),
    ("publish", 0, 0, 1),
    ("free", 1),
    ("finish", 0, "stop"),
    ("arrive", 1, (3, 1), 2, 0),
    ("begin", 1),
    ("schedule", 1, 2, 0),
    ("hit", 1, ()),
    ("alloc", 1, 2),
    ("submit", 1),
    ("begin", 2),
    ("schedule", 1, 1, 0),
    ("alloc", 1, 3),
    ("submit", 2),
    ("execute", 1, ()),
    ("commit", 1, ((1, 1),)),
    ("dedup", 1, 0, 1),
)
"""SGLang's overlap scheduler, the shortest history ``kvspec fuzz`` found (5 blocks of 2 tokens):
r0's page 1 is inserted when r0 finishes; r1, with the same two tokens, recomputes them into page 2
(a match leaves the last token to compute); step 2 decodes r1 on the token step 1 samples; when
step 1's result is processed SGLang inserts r1's page, finds page 1, frees page 2 and points r1's
row at page 1 (``dedup``), while step 2 still reads page 2."""
CONFIG = Config(
    num_blocks=5,
    block_size=2,
    depth=2,
    policy="engine-registers",
    discipline="general",
    token_budget=3,
    max_running=2,
    stop_token=0,
    async_scheduling=True,
)


def finding() -> str | None:
    """The observed judge's verdict on ``SGLANG_EVENTS``."""
    from kvspec.conformance.observed import ObservedJudge

    judge = ObservedJudge(CONFIG)
    found = judge.feed_all(list(SGLANG_EVENTS)) or judge.settle()
    return None if found is None else str(found)


def refuses() -> bool:
    """Whether the spec refuses SGLang's dedup while a submitted step reads the copy."""
    found = finding()
    return found is not None and "in flight still uses" in found


def dedup(s: State, effect: Event) -> list[Event]:
    """``spec/observed.py``'s ``dedup`` with the proposed guard: only the building step."""
    req, index, block = observed._named(s, effect)
    where = f"dedup r{req.id}'s block {index} to block {block}"
    if req.status != "running" or index >= len(req.table):
        raise Illegal(f"{where}: the request is not running with a block {index}")
    if s.blocks[block].key != s.key(req, index) or block in req.table:
        raise Illegal(f"{where}: not a published copy of r{req.id}'s block {index}")
    old = req.table[index]
    building = s.building
    entry = building.entries.get(req.id) if building is not None else None
    if building is not None and entry is not None and old in entry.blocks:
        raise Illegal(f"{where}: step {building.id}, being built, uses block {old}")
    b = s.blocks[block]
    if b.refcount == 0:
        s.free.remove(block)
    b.refcount += 1
    req.table[index] = block
    release(s, old, req.id)
    s.touched.blocks.add(block)
    s.touched.requests.add(req.id)
    s.touched.swapped.append((req.id, index, block))
    return [effect]


def apply() -> bool:
    """Install the proposed rule if the spec still refuses; True if it did."""
    if not refuses():
        return False
    observed.dedup = dedup
    return True
