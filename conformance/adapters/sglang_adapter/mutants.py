"""Wrong orders of SGLang's overlap scheduler that the judge must catch (``tests/test_adapter_sglang.py``).

Each mutant moves one of SGLang's own memory operations to a place where it is unsafe, and is a
``Scheduler`` subclass with a factory of its own (``--target
kvspec.conformance.adapters.sglang_adapter.mutants:insert_known_factory``). The orders they are
contrasted with are SGLang's, and those are safe on one GPU stream: what SGLang inserts while a
forward may still run (the previous chunk, the slot the launched batch N+1 writes for a request
that finished at N) is written by a forward launched before any reader of it, and what it frees
while a forward may still read it (a retracted request's pages, the copies a deduplicating insert
drops) is reused only by batches launched after that forward.

* ``InsertKnown`` (insert before the forward that writes): a prefill that goes on is inserted up
  to all its known tokens, the one it has just sampled included, whose K/V only the request's next
  forward computes. Under overlap that forward is often batch N+1, launched already, and the
  insert is then as safe as SGLang's own insert at finish; when N+1 does not decode the request
  (a prefill batch), nothing launched writes that position: NoUnwrittenPublish at the insert, and
  NoUnwrittenRead when another request hits the page before the write.
* ``LateRepoint`` (a freed slot still read): a deduplicating insert frees the request's copies
  at once, as ``RadixCache._insert_cache`` does, but rewrites the request's row only when the
  forward in flight has returned (as one might, to keep the row still while that forward reads
  it). Batches formed meanwhile still read the freed copies through the row, and the allocator
  hands them out again: an allocation of a page the spec counts as the request's (``Illegal``),
  else RefcountIsOwnership.
* ``RetractKeepsLock`` (a retraction that leaks): a retracted request's tree lock is never
  released, so its matched prefix stays pinned though no request holds it. Reached by fuzzing
  only in SGLang's retraction test mode (``retract_keeps_lock_retract_factory``; with SGLang's
  defaults, ``retract_keeps_lock_factory``, the fuzzer's pools rarely retract): the free sets
  disagree after the retraction.
* ``EarlyWindowFree`` (a window block freed while still read): the hybrid SWA model's frees of a
  running request's out-of-window SWA slots (``evict_sliding_windows`` at decode, the
  ``SWAComponent``'s ``_free_out_of_window_slots`` at insert) are run as if the request were two
  pages further on, so they free SWA pages inside the window the next forward reads, which then
  reads a window block its request gave up: the spec's ``NoUnwrittenRead``
  (``early_window_free_swa_factory``).
* ``ShortSnapshot`` (a state cached under too short a key): the hybrid SSM model's MAMBA
  component, inserting a running request's state (``MambaComponent.prepare_for_caching_req``,
  ``no_buffer``: a copy of the request's slot), returns a cache length one token short, so the
  tree keys the state after L tokens at L - 1 (the FULL pages with it): the spec's
  ``StateAtItsBoundary`` at the snapshot, and ``NoUnwrittenStateRead`` if a hit copies it
  before (``short_snapshot_mamba_factory``).
* ``SkipCow`` (a hit resumed from a stale slot): the MAMBA component's match
  (``finalize_match_result_in_cache``) takes the request's slot but drops the copy-on-write
  (``mamba_cow_src_index``), so the request computes from the FULL hit's end with whatever its
  slot held: the hit's slot group has no state, the spec's ``HitServedByEveryGroup``
  (``skip_cow_mamba_factory``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from . import supported
from .build import ComponentType, Req
from .loops import SglangAdapter
from .record import rid
from .scheduler import Scheduler


class InsertKnown(Scheduler):
    def insert_unfinished(self, req: Req) -> None:
        req.refresh_fill_ids()
        with self.record.acting_for(req):
            self.tree.checkpoint(req, up_to=len(req.full_untruncated_fill_ids))
        req.prefix_len = req.extend_end  # as checkpoint_kv_cache leaves it


class LateRepoint(Scheduler):
    def hook_tree(self) -> None:
        self.deferred: list[tuple[Req, int, Any, int]] = []
        """(request, first row position, the tree's slots, step whose result applies them)."""
        checkpoint = self.tree.checkpoint

        def checkpoint_(req: Req, *, up_to: int) -> None:
            if req.finished():  # the final insert: the row is released right after
                checkpoint(req, up_to=up_to)
                return
            row = self.pool.req_to_token[req.kv.req_pool_idx]
            start, before = req.kv.cache_protected_len, row.clone()
            checkpoint(req, up_to=up_to)  # frees the duplicates and repoints the row
            end = req.kv.cache_protected_len
            if not bool((row[start:end] != before[start:end]).any()):
                return
            self.deferred.append((req, start, row[start:end].clone(), self.next_step - 1))
            row[start:end] = before[start:end]  # the row stays on the freed copies for now

        self.tree.checkpoint = checkpoint_

    def before_result(self, step: int) -> None:
        due = [d for d in self.deferred if d[3] <= step]
        self.deferred = [d for d in self.deferred if d[3] > step]
        for req, start, slots, _ in due:
            if not req.kv.holds_kv or req.finished():
                continue
            table = self.record.row(req)
            self.pool.req_to_token[req.kv.req_pool_idx, start : start + len(slots)] = slots
            for index, (old, new) in enumerate(zip(table, self.record.row(req), strict=True)):
                if old != new:
                    self.events.append(("dedup", rid(req), index, new))


class RetractKeepsLock(Scheduler):
    @contextmanager
    def retracting(self, req: Req) -> Iterator[None]:
        unlock = self.tree.unlock
        self.tree.unlock = lambda lock: None
        try:
            yield
        finally:
            self.tree.unlock = unlock


class EarlyWindowFree(Scheduler):
    def hook_tree(self) -> None:
        ahead = 2 * self.page_size
        tree, component = self.tree, self.tree.components[ComponentType.SWA]
        evict_sliding_windows = tree.evict_sliding_windows
        free_out_of_window = component._free_out_of_window_slots

        def evict_sliding_windows_(req: Req, pre_len: int, **kw: Any) -> None:
            evict_sliding_windows(req, pre_len + ahead, **kw)

        def free_out_of_window_(req: Req, pre_len: int) -> None:
            free_out_of_window(req, pre_len + ahead)

        tree.evict_sliding_windows = evict_sliding_windows_
        component._free_out_of_window_slots = free_out_of_window_


class ShortSnapshot(Scheduler):
    def hook_tree(self) -> None:
        component = self.tree.components[ComponentType.MAMBA]
        prepare = component.prepare_for_caching_req

        def prepare_(req: Req, insert_params: Any, token_ids_len: int, is_finished: bool) -> Any:
            length = prepare(req, insert_params, token_ids_len, is_finished)
            return length - 1 if not is_finished and length else length

        component.prepare_for_caching_req = prepare_


class SkipCow(Scheduler):
    def hook_tree(self) -> None:
        component = self.tree.components[ComponentType.MAMBA]
        finalize = component.finalize_match_result_in_cache

        def finalize_(params: Any, result: Any) -> Any:
            result = finalize(params, result)
            req = params.req
            if req is not None and req.kv.mamba_cow_src_index is not None:
                req.kv.mamba_cow_src_index = None  # the slot keeps what it held
            return result

        component.finalize_match_result_in_cache = finalize_


class _MutantAdapter(SglangAdapter):
    scheduler_class: type[Scheduler] = Scheduler

    def new_scheduler(self, config: Config, choices: Choices, overlap: bool) -> Scheduler:
        return self.scheduler_class(config, choices, overlap, self.tree, self.test_retract)


def mutant(scheduler_class: type[Scheduler], overlap: bool = True) -> type[SglangAdapter]:
    """An adapter class whose scheduler is ``scheduler_class``."""
    return type(
        f"{scheduler_class.__name__}Adapter",
        (_MutantAdapter,),
        {"scheduler_class": scheduler_class},
    )


def _build(
    scheduler_class: type[Scheduler],
    config: Config,
    choices: Choices,
    test_retract: bool | None = None,
) -> SglangAdapter:
    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return mutant(scheduler_class)(config, choices, overlap=True, test_retract=test_retract)


def insert_known_factory(config: Config, choices: Choices) -> SglangAdapter:
    return _build(InsertKnown, config, choices)


def late_repoint_factory(config: Config, choices: Choices) -> SglangAdapter:
    return _build(LateRepoint, config, choices)


def retract_keeps_lock_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``RetractKeepsLock`` under SGLang's defaults: reached only where a decode runs out of
    pages, which the fuzzer's pools rarely make happen."""
    return _build(RetractKeepsLock, config, choices)


def retract_keeps_lock_retract_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``RetractKeepsLock`` in SGLang's retraction test mode (``retract_factory``)."""
    return _build(RetractKeepsLock, config, choices, test_retract=True)


def early_window_free_swa_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``EarlyWindowFree`` on ``swa_factory``'s cell (refused where ``swa_factory`` is)."""
    from . import swa_refusal

    why = swa_refusal(config)
    if why is not None:
        raise ValueError(why)
    return mutant(EarlyWindowFree)(config, choices, overlap=True, tree="swa")


def short_snapshot_mamba_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``ShortSnapshot`` on ``mamba_factory``'s cell (refused where ``mamba_factory`` is)."""
    from . import mamba_refusal

    why = mamba_refusal(config)
    if why is not None:
        raise ValueError(why)
    return mutant(ShortSnapshot)(config, choices, overlap=False, tree="mamba")


def skip_cow_mamba_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``SkipCow`` on ``mamba_factory``'s cell (refused where ``mamba_factory`` is)."""
    from . import mamba_refusal

    why = mamba_refusal(config)
    if why is not None:
        raise ValueError(why)
    return mutant(SkipCow)(config, choices, overlap=False, tree="mamba")
