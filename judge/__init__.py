"""The judge: an engine's events judged by the spec (``docs/architecture.md``).

``core`` (``Judge``: a model, a matching, a recorder), ``findings`` (what it finds, as data),
``spec_model`` (the spec as the model), ``incremental`` (the invariants evaluated where a decision
changed the state), ``fastmodel`` (the spec's twin for speed), ``recorder`` (the minimal history
of a report), ``handover`` (the fast model finds, the spec reports), ``ids`` (ids a stream
introduced), ``fastbuild`` (the hot path compiled by mypyc).
"""

from .core import Judge, Model
from .findings import Finding
from .ids import UnknownId

__all__ = ["Finding", "Judge", "Model", "UnknownId"]
