"""The engine's own registration (policy ``engine-registers``, traits ``publish=by-engine``):
what the engine caches, when, decided by the engine itself as SGLang's radix cache does, and
judged by the spec's observed judge (its effects are the engine's own: ``spec/observed.py``).

Why a policy of its own: the spec's policies cache nothing of a slot group (SGLang's MAMBA
``no_buffer``): a recurrent state lives in one slot per request, overwritten by every step, and
is cached only by a copy the engine makes at a moment it chooses. The rule (docs/hybrid.md,
"Slot groups in the reference engine"):

* Blocks of the other groups: published at the commit of the step that wrote them, as
  ``deferred`` does (``publish`` events, now the engine's own).
* A state by copy: when a running request is scheduled and the tokens it has computed, ``c``,
  end a block of the slot group inside its prompt (``0 < c <= prompt``, ``c`` a multiple of
  the group's block size) and no state is cached there yet, its slot is copied into the free
  queue's head, published at ``c`` (``snapshot``; ``evict`` first for a cached block). The
  copy runs first in the step being built, after every earlier step has run and before this
  step rewrites the slot: it holds the state after exactly ``c`` tokens (the end of a chunked
  prefill).
* A state by donation: a request that finishes at a commit gives its slot (free now) to the
  cache at its last entry's end, when that end is a boundary with no state cached there and
  no later submitted step holds the request (such a step still runs and rewrites the slot).
* A hit of a slot group (``groups.GroupedKV``) copies the longest state every group accepts
  into the fresh slot; nothing of a slot group is ever referenced by another request.

Under ``EngineConfig.slot_buffer == "extra_buffer"`` (SGLang's other MAMBA strategy, at depth
1 here) no state is copied: the admission is followed by two track slots (the engine's own
``alloc``s); each schedule whose entry crosses a boundary of the slot group lays a ``track``
write of the state at the last boundary ``t`` it reaches into one of them, in turn
(ping-pong); at the commit of that step the written track slot is donated in place
(``snapshot``) when no state is cached at ``t``, and a fresh track slot fills its position.
A finished request donates its working slot as under ``no_buffer``.

Window groups beside group 0 are let go of by the engine itself, at each step's begin
(``GroupedKV.let_go_windows``, enabled by ``Engine`` for this policy), as SGLang's SWA component
gives up its out-of-window pages; state and chunked groups free their skipped blocks at
schedule, as under the spec's policies.
"""

from __future__ import annotations

from .block_pool import Block
from .config import PolicyTraits
from .groups import GroupedKV
from .kv_cache_manager import KVCacheManager
from .policies import TraitPolicy
from .request import RUNNING, Entry, Request, Step


class EngineRegisters(TraitPolicy):
    """``deferred``'s publishing at commit, plus the snapshots of slot groups' states."""

    TRAITS = PolicyTraits("by-engine", "nothing", "nothing", "never")
    __slots__ = ("slot_groups", "extra", "tracked", "turn")

    def __init__(self, kv: KVCacheManager) -> None:
        super().__init__(kv, PolicyTraits("at-written", "nothing", "nothing", "never"))
        groups = kv.groups if isinstance(kv, GroupedKV) else ()
        self.slot_groups = [g for g, spec in enumerate(groups) if spec.kind == "slot"]
        self.extra = isinstance(kv, GroupedKV) and kv.tracks_per_request > 0
        """``extra_buffer``: track slots instead of copies."""
        self.tracked: dict[int, list[tuple[int, int, Block, int]]] = {}
        """Per request, its track writes not donated yet: (step, group, block, t)."""
        self.turn: dict[int, int] = {}
        """Per request, the track slot position (1 or 2) its next track write takes."""

    def _cached(self, kv: GroupedKV, req: Request, g: int, end: int) -> bool:
        return kv.pool.cached_block(kv.state_key(req, g, end)) is not None

    def on_schedule(self, req: Request, step: Step, end: int) -> None:
        """A snapshot by copy of the state the request's slot holds when this step starts."""
        kv = self.kv
        if not self.slot_groups or not isinstance(kv, GroupedKV):
            return
        if self.extra:
            self._track(kv, req, step)
            return
        c = step.entries[req.rid].start
        if not 0 < c <= req.prompt_len or c > len(req.tokens):
            return
        tables = kv.tables(req)
        for g in self.slot_groups:
            if c % kv.groups[g].block_size or not tables[g] or self._cached(kv, req, g, c):
                continue
            kv.snapshot_state(req, g, c, tables[g][0])

    def on_finish(self, req: Request, entry: Entry, later: bool) -> None:
        """A donation of the finished request's slot at its last entry's end."""
        kv = self.kv
        if not self.slot_groups or not isinstance(kv, GroupedKV):
            return
        self.on_remove(req, ())
        if req.rid in kv.let_go and not later:  # (snapshot_state reads the slot from let_go)
            end = entry.end
            for g in self.slot_groups:
                if end % kv.groups[g].block_size == 0 and not self._cached(kv, req, g, end):
                    kv.snapshot_state(req, g, end, None)
        kv.let_go.pop(req.rid, None)

    def _track(self, kv: GroupedKV, req: Request, step: Step) -> None:
        """``extra_buffer``: a fresh admission's track slots, then the entry's track write."""
        entry, rid = step.entries[req.rid], req.rid
        for g in self.slot_groups:
            table = kv.tables(req)[g]
            if len(table) == 1:  # just admitted: its working slot only
                for _ in range(kv.tracks_per_request):
                    kv.alloc_track(req, g)
                self.turn[rid] = 1
            size = kv.groups[g].block_size
            t = entry.end // size * size
            if t <= entry.start:
                continue
            position = self.turn.get(rid, 1)
            block = table[position]
            self.turn[rid] = 3 - position
            if kv.pool.events is not None:
                kv.pool.events.append(("track", rid, block.block_id, t, g))
            kv.copies.track(step.step_id, rid, block, t)
            self.tracked.setdefault(rid, []).append((step.step_id, g, block, t))

    def on_committed(self, step: Step, requests: dict[int, Request]) -> None:
        """``extra_buffer``: at the end of the commit, the donation of each track slot the step
        wrote for a request still running, and a fresh one in its place."""
        kv = self.kv
        if not self.tracked or not isinstance(kv, GroupedKV):
            return
        for rid in step.entries:
            writes = self.tracked.get(rid)
            req = requests[rid]
            if not writes or rid not in step.live or req.status != RUNNING:
                continue
            for sid, g, block, t in [w for w in writes if w[0] == step.step_id]:
                writes.remove((sid, g, block, t))
                if t <= len(req.tokens) and not self._cached(kv, req, g, t):
                    kv.donate_track(req, g, block, t)
                    kv.alloc_track(req, g)

    def on_remove(self, req: Request, steps: object) -> None:
        """The request left: its track writes are not donated (its tables are given up)."""
        self.tracked.pop(req.rid, None)
        self.turn.pop(req.rid, None)


def make_own(traits: PolicyTraits, kv: KVCacheManager) -> EngineRegisters:
    """The engine's own registration for ``traits`` (``publish="by-engine"``), which must be
    ``EngineRegisters.TRAITS``: the only combination it implements."""
    if traits != EngineRegisters.TRAITS:
        raise ValueError(f"publish=by-engine goes with {EngineRegisters.TRAITS}, got {traits}")
    return EngineRegisters(kv)
