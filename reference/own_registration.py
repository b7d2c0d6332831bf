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
"""

from __future__ import annotations

from .config import PolicyTraits
from .groups import GroupedKV
from .kv_cache_manager import KVCacheManager
from .policies import TraitPolicy
from .request import Entry, Request, Step


class EngineRegisters(TraitPolicy):
    """``deferred``'s publishing at commit, plus the snapshots of slot groups' states."""

    TRAITS = PolicyTraits("by-engine", "nothing", "nothing", "never")
    __slots__ = ("slot_groups",)

    def __init__(self, kv: KVCacheManager) -> None:
        super().__init__(kv, PolicyTraits("at-written", "nothing", "nothing", "never"))
        groups = kv.groups if isinstance(kv, GroupedKV) else ()
        self.slot_groups = [g for g, spec in enumerate(groups) if spec.kind == "slot"]

    def _cached(self, kv: GroupedKV, req: Request, g: int, end: int) -> bool:
        return kv.pool.cached_block(kv.state_key(req, g, end)) is not None

    def on_schedule(self, req: Request, step: Step, end: int) -> None:
        """A snapshot by copy of the state the request's slot holds when this step starts."""
        kv = self.kv
        if not self.slot_groups or not isinstance(kv, GroupedKV):
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
        slots = kv.let_go.pop(req.rid, None)
        if slots is None or later:
            return
        kv.let_go[req.rid] = slots  # (snapshot_state reads it)
        end = entry.end
        for g in self.slot_groups:
            if end % kv.groups[g].block_size == 0 and not self._cached(kv, req, g, end):
                kv.snapshot_state(req, g, end, None)
        kv.let_go.pop(req.rid, None)
