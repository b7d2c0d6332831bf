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


@dataclass(frozen=True, slots=True)
class Executed:
    """The worker executed step ``step`` (event ``event_index`` of the trace): every write of
    the batch, then every read, per layer."""

    step: int
    event_index: int
    work: tuple[Work, ...]
    """The step's entries in scheduling order."""


Record = Fill | Executed
