"""What a replay reports (``replay.py``): the first output off dense attention (``Mismatch``),
the blocks blamed for it (``BadBlock``: which group, which positions or which state, a zombie
or computed from a wrong read), and the figures of a run (``Result``). Plain dataclasses whose
``str`` is the line ``kvspec replay`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BadBlock:
    """A block of the reader's table whose K/V differ from the true K/V of the reader's prefix."""

    block: int
    index: int
    """Its position in the reader's table."""
    positions: tuple[int, int]
    """First and last wrong position."""
    zombie: bool
    """Read as a prefix it never held since its allocation (else: it held the prefix, but its
    K/V were computed from a wrong read)."""
    never_written: bool
    """Nothing was written to the wrong positions since the block's allocation (NaN)."""
    group: int = 0
    kind: str = "full"
    """The group's kind: a ``state`` block holds one state, read by a step starting at
    ``positions[0]`` (its prefix: the tokens before it)."""

    def __str__(self) -> str:
        if self.kind == "state":
            where = (
                f"group {self.group}'s state block {self.block} (table index {self.index}, "
                f"the state after {self.positions[0]} tokens)"
            )
            if self.zombie and self.never_written:
                return f"{where} is a zombie: never written since its allocation"
            if self.zombie:
                return f"{where} is a zombie: it holds another prefix's state"
            return f"{where} holds this prefix's state computed from a wrong read"
        group = f"group {self.group}'s " if self.group else ""
        where = (
            f"{group}block {self.block} (table index {self.index}, "
            f"positions {self.positions[0]}..{self.positions[1]})"
        )
        if self.zombie and self.never_written:
            return f"{where} is a zombie: read as this prefix, never written since its allocation"
        if self.zombie:
            return f"{where} is a zombie: read as this prefix, it holds another prefix's K/V"
        return f"{where} holds this prefix's K/V computed from a wrong read"


@dataclass(frozen=True)
class Mismatch:
    step: int
    event_index: int
    req: int
    layer: int
    error: float
    positions: tuple[int, int]
    """First and last query position off by more than the tolerance."""
    blocks: tuple[BadBlock, ...]
    group: str = ""
    """Several groups: the layer's group, as ``group 1: window 4``."""

    def __str__(self) -> str:
        layer = f"layer {self.layer} ({self.group})" if self.group else f"layer {self.layer}"
        head = (
            f"step {self.step} (event {self.event_index}): r{self.req}, {layer}, "
            f"queries at positions {self.positions[0]}..{self.positions[1]} "
            + ("give NaN" if self.error != self.error else f"off by {self.error:.3g}")
        )
        if not self.blocks:
            return head + "; every block holds the right K/V: the attention itself is wrong"
        return head + "; " + "; ".join(str(b) for b in self.blocks)


@dataclass
class Result:
    steps: int = 0
    """Executed steps replayed."""
    queries: int = 0
    """Query tokens compared with dense attention (each in every layer)."""
    max_error: float = 0.0
    """Largest absolute difference over every compared output (before any mismatch)."""
    step_errors: list[tuple[int, float]] = field(default_factory=list)
    mismatch: Mismatch | None = None
