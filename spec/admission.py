"""Cache-aware admission: the order vLLM's fcfs queue is admitted in once its pool is busy.

vLLM 0.34.0's ``cache_aware_admission_window`` (``Config.admission_window``): in a step that
preempted nothing, before the first waiting request is admitted, if the pool's usage (the share
of its blocks, the null block aside, that are not free) is at least ``Config.admission_threshold``
the first ``window`` requests of the waiting queue are reordered: those merely waiting (never
preempted, not loading) move among their own positions so that the deepest cached prefix (the
spec's own lookup, in tokens) goes first, arrival position breaking ties; every other request
keeps its position and the queue beyond the window is untouched. The new order stays in the
queue (later steps reorder from it). Applied once per step (``Step.reordered``): at the step's
first admission, or at its submit when it admits nothing, since nothing between vLLM's reorder
point and either changes the pool or the index. ``docs/model.md``, "Cache-aware admission".
"""

from __future__ import annotations

from .pool import lookup
from .state import State, Step


def cached_tokens(s: State, rid: int) -> int:
    """Tokens of request ``rid`` an admission now would hit (vLLM's ``get_num_cached_tokens``:
    the lookup's hit, the last known token excluded, nulls before a window counted)."""
    return len(lookup(s, s.requests[rid])) * s.config.block_size


def usage(s: State) -> float:
    """The pool's usage as vLLM computes it: 1 - free / (N - 1), 0 for a pool of the null block."""
    usable = s.config.num_blocks - 1
    return 1.0 - len(s.free) / usable if usable else 0.0


def reordered(s: State) -> list[int] | None:
    """The waiting queue after the cache-aware reorder, or None where the rule leaves it as is
    (off, not fcfs, no caching, fewer than two waiting or movable, usage below the threshold)."""
    cfg = s.config
    if not cfg.admission_window or cfg.preemption != "fcfs" or not cfg.prefix_caching:
        return None
    if len(s.waiting) < 2 or usage(s) < cfg.admission_threshold:
        return None
    head = s.waiting[: cfg.admission_window]
    slots = [i for i, rid in enumerate(head) if movable(s, rid)]
    if len(slots) < 2:
        return None
    cached = {i: cached_tokens(s, head[i]) for i in slots}
    order = sorted(slots, key=lambda i: (-cached[i], i))
    new = list(head)
    for slot, source in zip(slots, order, strict=True):
        new[slot] = head[source]
    return new + s.waiting[len(head) :]


def movable(s: State, rid: int) -> bool:
    """Merely waiting (vLLM's ``WAITING`` with no computed tokens): never preempted since it
    arrived, no load under way, nothing computed."""
    req = s.requests[rid]
    return not req.preempted and req.loading is None and req.computed == 0


def reorder_once(s: State, step: Step) -> None:
    """Apply the rule to the waiting queue, once in ``step`` and not in a step that preempted."""
    if not s.config.admission_window or step.reordered or step.preempted:
        return  # off: nothing recorded (the other forms' states have neither field set)
    step.reordered = True
    new = reordered(s)
    if new is not None and new != s.waiting:
        s.waiting[:] = new
        s.touched.requests.update(new)
