"""The pool-level judge: a pool's event stream replayed through ``kvspec.spec.pool_machine``.

The layer below the engine judge (``judge.core.Judge``): for code that drives a block pool directly,
with no scheduler and no steps (vLLM's ``KVCacheManager`` and ``BlockPool`` tests, attached by
``adapters/vllm_adapter/pool_attach.py``). Each *decision* of the pool vocabulary (lookup, slots,
touch, allocate, free, publish, evict, reset, slots_done, alias, move, unpin, give) is applied to the pool machine; the
engine's *effects* that follow (``hit``, ``evicted``, ``alloc``) must be exactly the machine's, in
order; after every decision TouchBeforeAllocate is checked, and every pool invariant at each
consistent point (``check_now``, which ``compare`` calls). ``compare`` checks the engine's
observable pool (every refcount, the free queue in order, which blocks are cached under which
keys, the unpinned blocks still read) first against ``OBSERVED_INVARIANTS`` (the engine's pool
with the machine's holders and ghost variables: a key kept past an eviction or a move, a reused
block whose reader was not told, a lost free block are named), then for equality with the
machine's. The first problem found is kept, as in the engine's ``Judge``: a pool
invariant's name, ``Disagreement`` (the engine's effects or state differ from the machine's) or
``Illegal`` (a decision whose guard is false: a double free, a touch of a block that is not free
and unreferenced, ...).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kvspec.spec import Illegal, Violation
from kvspec.spec.pool_machine import (
    OBSERVED_INVARIANTS,
    POOL_ACTIONS,
    POOL_INVARIANTS,
    PoolState,
    apply_pool,
    cached_keys,
    check_pool,
    initial_pool,
    observed,
    touch_before_allocate,
)

Event = tuple[object, ...]

EXPLANATIONS = {
    "Disagreement": "The pool and the pool machine disagree on an observable: a bug in one of them.",
    "Illegal": "The pool took a decision that no pool action allows in this state.",
}


@dataclass(frozen=True)
class PoolFinding:
    invariant: str
    """A pool invariant's name, ``Disagreement`` or ``Illegal``."""
    message: str
    event: int
    """Index of the event in the stream at which it was found."""
    violation: Violation | None = None

    @property
    def explanation(self) -> str:
        predicate = POOL_INVARIANTS.get(self.invariant)
        doc = predicate.__doc__ if predicate is not None else EXPLANATIONS.get(self.invariant)
        return " ".join((doc or "").split())

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message} (pool event {self.event})"


class PoolJudge:
    """Feed pool events with ``feed``; compare the engine's pool with ``compare``. Stops at its
    first finding and returns it from then on."""

    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        self.state: PoolState = initial_pool(num_blocks, caching)
        self.expected: deque[Event] = deque()
        self.events_seen = 0
        self.decisions = 0
        self.finding: PoolFinding | None = None

    def feed(self, event: Event) -> PoolFinding | None:
        if self.finding is not None:
            return self.finding
        index = self.events_seen
        self.events_seen += 1
        if event and event[0] in POOL_ACTIONS:
            if self.expected:
                return self._found("Disagreement", f"missing effect {self.expected[0]}", index)
            try:
                self.expected.extend(apply_pool(self.state, event))
            except Illegal as err:
                return self._found("Illegal", str(err), index)
            self.decisions += 1
            violated = touch_before_allocate(self.state)  # pending hits live only inside a call
            if violated is not None:
                return self._found(violated.invariant, violated.sentence, index, violated)
            return None
        want = self.expected.popleft() if self.expected else None
        if event != want:
            return self._found(
                "Disagreement", f"pool emitted {event}, machine expects {want}", index
            )
        return None

    def feed_all(self, events: Iterable[Event]) -> PoolFinding | None:
        for event in events:
            if self.feed(event) is not None:
                break
        return self.finding

    def settle(self) -> PoolFinding | None:
        """At a point where the pool has emitted everything: no effect may be missing."""
        if self.finding is None and self.expected:
            self._found("Disagreement", f"missing effect {self.expected[0]}", self.events_seen)
        return self.finding

    def check_now(self) -> PoolFinding | None:
        """Every pool invariant, now. ``feed`` checks TouchBeforeAllocate after every decision
        (its pending hits live only inside an ``allocate_slots`` call); the others, which read
        every block, at the consistent points where ``compare`` is called."""
        if self.finding is None:
            violated = check_pool(self.state)
            if violated is not None:
                self._found(violated.invariant, violated.sentence, self.events_seen, violated)
        return self.finding

    def compare(
        self,
        refcounts: tuple[int, ...],
        free: tuple[int, ...],
        keys: dict[int, Hashable],
        watched: tuple[int, ...] | None = None,
    ) -> PoolFinding | None:
        """The engine's refcounts (null block as 0), free queue (head first), cached blocks
        (block -> key, or the frozenset of its keys where it has several) and, where given, the
        unpinned blocks still read, against the machine's."""
        if self.settle() is not None or self.check_now() is not None:
            return self.finding
        s, at = self.state, self.events_seen
        if len(refcounts) == len(s.blocks) and all(0 <= b < len(s.blocks) for b in keys):
            seen = observed(s, refcounts, free, keys, watched)
            for predicate in OBSERVED_INVARIANTS.values():
                violated = predicate(seen)
                if violated is not None:
                    return self._found(violated.invariant, violated.sentence, at, violated)
        mine = (0,) + tuple(b.refcount for b in s.blocks[1:])
        if refcounts != mine:
            diff = [i for i, (a, b) in enumerate(zip(refcounts, mine, strict=False)) if a != b][:8]
            return self._found("Disagreement", f"refcounts differ at blocks {diff}", at)
        if free != tuple(s.free):
            return self._found(
                "Disagreement", f"free queue {list(free)[:12]}, machine {s.free[:12]}", at
            )
        cached = cached_keys(s)
        if keys != cached:
            odd = sorted(set(keys) ^ set(cached) or {b for b in keys if keys[b] != cached[b]})
            return self._found("Disagreement", f"cached blocks differ at {odd[:8]}", at)
        if watched is not None and tuple(watched) != tuple(s.watched):
            return self._found(
                "Disagreement",
                f"unpinned blocks read {list(watched)[:8]}, machine {list(s.watched)[:8]}",
                at,
            )
        return None

    def _found(
        self, invariant: str, message: str, index: int, violation: Violation | None = None
    ) -> PoolFinding:
        self.finding = PoolFinding(invariant, message, index, violation)
        return self.finding
