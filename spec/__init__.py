"""kvspec.spec: the executable specification of the KV-cache block lifecycle.

Read it like a TLA+ module, in this order: ``state`` (constants and variables), ``pool`` (the
block pool's mechanisms), ``policies`` (when hashes become visible), ``actions`` (one function per
engine decision: guard, then effect) and ``invariants`` (what must hold in every state).
``incremental`` re-evaluates the invariants after a decision where it changed the state: an
optimization with the same answers, not part of the model.
Pure standard-library Python; it imports nothing else of kvspec.
"""

from .actions import ACTIONS, apply, waiting_order
from .invariants import INVARIANTS, Violation, check, running_tables, tables_append_only
from .policies import POLICIES, Traits
from .state import (
    DISCIPLINES,
    NULL_BLOCK,
    OBSERVED_POLICIES,
    PREEMPTIONS,
    STALE_OUTPUTS,
    Config,
    Illegal,
    Placeholder,
    State,
    initial_state,
)

__all__ = [
    "ACTIONS",
    "DISCIPLINES",
    "INVARIANTS",
    "NULL_BLOCK",
    "OBSERVED_POLICIES",
    "POLICIES",
    "PREEMPTIONS",
    "STALE_OUTPUTS",
    "Placeholder",
    "Config",
    "Illegal",
    "State",
    "Traits",
    "Violation",
    "apply",
    "check",
    "initial_state",
    "running_tables",
    "tables_append_only",
    "waiting_order",
]
