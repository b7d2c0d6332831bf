"""Findings: what a judge found, as data, and what each kind of finding guards against.

A ``Finding`` names an invariant (or ``Disagreement``, ``Illegal``, ``HashChainConsistent``,
``EngineError``, ``EngineHung``, ``EngineNeverIdle``, or a check of the engine's own books,
``engine_view.VIEW_CHECKS``), the event at which it was found, the blocks and requests it is about and a
sentence; reports (``conformance/report.py``) render it, never parse it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec.spec import INVARIANTS

HASH_CHAIN = "HashChainConsistent"
EXPLANATIONS = {
    "Disagreement": "The engine and the spec disagree on an observable: a bug in one of them.",
    "EngineError": "The engine raised an exception on an input the workload may send.",
    "EngineHung": "An engine call did not return within the time budget (kvspec fuzz --seconds, "
    "conformance/watchdog.py): a deadlock or an endless loop the workload can reach.",
    "EngineNeverIdle": "With no new request, an engine must finish its work and become idle "
    "(step() returns False); this one kept working, a livelock the workload can reach.",
    "Illegal": "The engine took a decision that no action of the spec allows in this state.",
    "TablesAppendOnly": "While a request stays running its table only grows at its end: a block "
    "it has computed into is never swapped for another under it.",
    HASH_CHAIN: "The engine's opaque block hashes agree with the token chain: one hash names one "
    "token prefix, and one prefix has one hash. A mismatch means a lookup can hit a block holding "
    "other tokens (or miss a valid one).",
}
"""What each finding that is not an invariant guards (an invariant's is its docstring)."""


def explanation(invariant: str) -> str:
    """What a finding's invariant guards against, in a sentence or two (a KV-event stream's
    invariants, ``spec/stream.py``, included: a stream finding inside ``kvspec fuzz``)."""
    from kvspec.conformance.engine_view import VIEW_CHECKS
    from kvspec.spec.stream import INVARIANTS as STREAM

    predicate = INVARIANTS.get(invariant) or STREAM.get(invariant)
    known = EXPLANATIONS.get(invariant) or VIEW_CHECKS.get(invariant, "")
    doc = predicate.__doc__ if predicate is not None else known
    return " ".join((doc or "").split())


@dataclass(frozen=True)
class Finding:
    invariant: str
    """An invariant's name, ``Disagreement``, ``Illegal``, ``HashChainConsistent`` or
    ``EngineError``."""
    message: str
    event: int
    """Index of the event in the stream at which it was found."""
    blocks: tuple[int, ...] = ()
    """The blocks it is about (an invariant's ``Violation.blocks``, a disagreement's events')."""
    requests: tuple[int, ...] = ()
    line: int | None = None
    """Where that event is in its file (its index + 1 for an in-process stream)."""
    arose_after: int | None = None
    """Checking every k decisions: the line of the last check that passed before it."""
    error_type: str | None = None
    """``EngineError``: the exception's type."""
    frames: tuple[str, ...] = ()
    """``EngineError``: the innermost frames of the engine's code, ``file:line in function``,
    innermost last."""

    @property
    def explanation(self) -> str:
        return explanation(self.invariant)

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message} (event {self.event})"


class UnknownId(ValueError):
    """An event names a request or step that never existed: the input is not a trace. (Here, not
    beside the id checks, so that the compiled build and the source raise the same class.)"""
