"""Slot groups (SGLang's MAMBA component, ``no_buffer``; docs/hybrid.md, "Slot groups in the
reference engine"): the copies of whole states, which no other group kind makes.

A slot group holds ONE block per request, its slot, read and rewritten in place by every step
(``groups.GroupedKV`` allocates it; ``memory.GroupMemory`` reads and writes it). A state is
cached by copying it into another block, and a hit is served by copying the published state
into the fresh slot. A copy is made while the scheduler works and runs on the device first
thing in a step's execute, in the order the copies were made, before the step's reads and
writes: the copies of step ``S`` see every write of the steps before ``S`` and none of
``S``'s. ``SlotCopies`` keeps them until their step executes; the scheduler withdraws a
request's copies from the building step when it leaves it (its admission did not happen).

Under ``extra_buffer`` (``own_registration.py``) a request also holds two track slots, and a
step may leave the state at a boundary inside its entry in one of them: a ``TrackWrite``,
landed after the step's reads (as garbage when the entry read a wrong state), withdrawn with
the entry.
"""

from __future__ import annotations

from typing import NamedTuple

from .block_pool import Block


class Copy(NamedTuple):
    """Block ``target`` takes block ``source``'s bytes when step ``step`` executes (made for
    request ``rid``: its admission's hit, or a snapshot of its state)."""

    step: int
    source: Block
    target: Block
    rid: int
    gen: int
    """The target's generation when the copy was made (the use it is made for)."""


class TrackWrite(NamedTuple):
    """Request ``rid``'s entry in step ``step`` also leaves the state after ``t`` tokens in its
    track slot ``block`` (``extra_buffer``), after the step's reads; ``gen``: the block's
    generation when the write was laid."""

    step: int
    rid: int
    block: Block
    gen: int
    t: int


class SlotCopies:
    """The copies not run yet, in the order they were made, and the step ids they run in: the
    building step's (``building``), or with none building the next one to begin (``next``)."""

    __slots__ = ("pending", "started", "is_building", "tracks")

    def __init__(self) -> None:
        self.pending: list[Copy] = []
        self.tracks: list[TrackWrite] = []
        """Track writes not landed yet (``extra_buffer``), in the order they were laid."""
        self.started = 0
        """Steps begun so far: the building step is ``started - 1``."""
        self.is_building = False

    def begin(self) -> None:
        """A step starts being built."""
        self.started += 1
        self.is_building = True

    def submitted(self) -> None:
        """The building step was submitted: a copy made now runs in the next step."""
        self.is_building = False

    @property
    def building(self) -> int:
        """The step being built."""
        return self.started - 1

    @property
    def now(self) -> int:
        """The step a copy made now runs in: the building one, or the next to begin."""
        return self.started - 1 if self.is_building else self.started

    def make(self, step: int, source: Block, target: Block, rid: int) -> None:
        self.pending.append(Copy(step, source, target, rid, target.generation))

    def withdraw(self, step: int, rid: int, targets: list[Block]) -> None:
        """The request left the building step ``step``: its copies into ``targets`` (its own
        tables' blocks) made for that step do not run."""
        ids = {b.block_id for b in targets}
        self.pending = [
            c
            for c in self.pending
            if not (c.step == step and c.rid == rid and c.target.block_id in ids)
        ]
        self.tracks = [w for w in self.tracks if not (w.step == step and w.rid == rid)]

    def track(self, step: int, rid: int, block: Block, t: int) -> None:
        """Lay a track write for step ``step`` (``TrackWrite``)."""
        self.tracks.append(TrackWrite(step, rid, block, block.generation, t))

    def take_tracks(self, step: int) -> list[TrackWrite]:
        """The track writes step ``step`` lands, in order, removed from ``tracks``."""
        mine = [w for w in self.tracks if w.step == step]
        if mine:
            self.tracks = [w for w in self.tracks if w.step != step]
        return mine

    def take(self, step: int) -> list[Copy]:
        """The copies step ``step`` runs, in order, removed from ``pending``."""
        mine = [c for c in self.pending if c.step == step]
        if mine:
            self.pending = [c for c in self.pending if c.step != step]
        return mine
