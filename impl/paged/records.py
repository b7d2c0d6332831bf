"""The records a replay consumes: what the worker must do, step by step, on real tensors.

A *plan* is an iterable of these records in trace order. ``kvspec.conformance.plan`` builds one
from an event file by running it through the spec; ``impl/paged/replay.py`` executes it. They are plain
frozen dataclasses so that ``impl/`` needs nothing of the spec or of the conformance layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fill:
    """A block was just allocated: its bytes are garbage until written (the replay fills NaN)."""

    block: int


@dataclass(frozen=True, slots=True)
class Work:
    """One request's part in an executed step.

    Compute (or, for a load, copy in) the K/V of positions ``start .. end - 1`` into the table
    ``blocks`` (block ``i`` holds positions ``i*B .. (i+1)*B - 1``); a computing entry then
    attends with its queries ``start .. end - 1`` over the context ``0 .. end - 1``."""

    req: int
    tokens: tuple[int, ...]
    """The request's tokens ``0 .. end - 1``: what its K/V and queries are functions of."""
    start: int
    end: int
    blocks: tuple[int, ...]
    load: bool
    """An external KV load: writes K/V, reads nothing."""
    failed: bool
    """The load failed: nothing is written."""
    live: bool
    """The request's result is used at commit (not preempted or aborted since scheduling)."""
    groups: tuple[tuple[int, ...], ...] = ()
    """Several KV-cache groups: the table prefix of each group 1 .. G - 1 (``blocks`` is group
    0's), laid out by its ``GroupLayout``: a full or window group's block ``i`` holds positions
    ``i*B_g .. (i+1)*B_g - 1``; a state group's block ``i`` holds one state, the recurrence after
    some number of tokens in ``i*B_g + 1 .. (i+1)*B_g`` (a step reads the block of the position
    it starts at and writes the block of the position it ends at)."""


@dataclass(frozen=True, slots=True)
class Executed:
    """The worker executed step ``step`` (event ``event_index`` of the trace): every write of
    the batch, then every read, per layer."""

    step: int
    event_index: int
    work: tuple[Work, ...]
    """The step's entries in scheduling order."""


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One KV-cache group as the replay lays it out: ``kind`` ``full``, ``window`` (attention
    over the last ``window`` keys) or ``state``; its own ``block_size``. Block ids are global
    (one shared pool): a block is in one group's tables at a time."""

    kind: str
    block_size: int
    window: int = 0


Record = Fill | Executed
