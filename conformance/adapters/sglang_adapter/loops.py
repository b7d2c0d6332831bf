"""The adapter: SGLang's two event loops over ``Scheduler`` (``scheduler.py``), one loop iteration per
``step``, and the rest of the adapter protocol (``conformance/adapter.py``).

``event_loop_overlap`` (SGLang's default, ``managers/scheduler.py`` lines 2061-2134) forms batch
N+1 and launches it, then processes batch N's result::

    batch = get_next_batch_to_run()        # stash the chunk N wrote, merge N, admit or decode
    if batch: run_batch(batch)             # spec: begin .. submit of step N+1
    if last_batch: pop_and_process()       # spec: execute, commit of step N, then its effects
    last_batch = batch

``event_loop_normal`` (lines 2026-2059, ``--disable-overlap-schedule``) runs and processes each
batch before forming the next. Both loops call the same ``Scheduler`` methods; only their order
differs. Under overlap a decode of N+1 reads the token N samples (SGLang's ``FutureMap``,
``managers/overlap_utils.py``: ``resolve_forward_inputs`` gathers ``output_tokens_buf`` at the
request's row on the device), which the spec models as a placeholder: the cell is
``async_scheduling=True`` at depth 2.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from .build import swa_layers
from .record import Event
from .scheduler import Scheduler


def hybrid_swa_config(config: Config) -> Config:
    """The cell as the judge sees a hybrid SWA model: both pools' pages as one id space (the FULL
    pool's ``num_blocks - 1`` pages, then as many SWA pages, ``swa.py``) and, where the spec has
    KV-cache groups, group 0 full attention and group 1 the model's window (``docs/hybrid.md``)."""
    pages = config.num_blocks - 1
    config = replace(config, num_blocks=2 * pages + 1)
    group = spec_group()
    if group is None:
        return config
    window = swa_layers()[0]
    groups = (group("full", config.block_size), group("window", config.block_size, window=window))
    return replace(config, groups=groups)


def hybrid_mamba_config(config: Config, extra: bool = False) -> Config:
    """The cell as the judge sees a hybrid SSM model (``mamba.py``): pages of 1 token (SGLang's
    no_buffer MAMBA component asserts them: a cached state needs a page boundary at every key's
    end), as many as the cell's ``num_blocks - 1`` pages hold tokens, then the ``MambaPool``'s
    state slots (3 per running request, as SGLang sizes them, 5 with ``extra``: its ping-pong
    track slots, ``extra.py``), one id space; group 0 full attention, group 1 the spec's ``slot``
    kind (where the spec has it)."""
    from .mamba import slots_for

    pages = (config.num_blocks - 1) * config.block_size
    blocks = 1 + pages + slots_for(config.max_running, extra)
    config = replace(config, num_blocks=blocks, block_size=1)
    group = spec_group()
    if group is None or not spec_has_slot():
        return config
    return replace(config, groups=(group("full", 1), group("slot", 1)))


def spec_has_slot() -> bool:
    """Whether the spec follows the ``slot`` group kind (a recurrent state in one slot per
    request, cached by copy: ``snapshot``)."""
    try:
        from kvspec.spec.state import GROUP_KINDS
    except ImportError:
        return False
    return "slot" in GROUP_KINDS


def spec_follows_groups() -> bool:
    """Whether the spec follows several KV-cache groups as SGLang's events need it: its own
    ``schedule`` of a new request on the SWA cell emits a ``hit`` for each group, and it takes an
    engine's own ``publish`` in group 1 under ``engine-registers`` (``docs/hybrid.md``;
    ``docs/adapters.md``, "Hybrid models"). Until both hold, the spec would take the second
    group's events for a disagreement or an illegal effect: a false alarm."""
    from kvspec.spec import Illegal, apply, initial_state
    from kvspec.spec.observed import engine_effect

    if spec_group() is None:
        return False
    config = Config(num_blocks=5, block_size=2)
    config = hybrid_swa_config(replace(config, policy="engine-registers"))
    state = initial_state(config)
    apply(state, ("arrive", 0, (1, 2, 3), 1, 0))
    apply(state, ("begin", 0))
    effects = apply(state, ("schedule", 0, 3, 0))
    if sum(event[0] == "hit" for event in effects) != len(config.groups):
        return False
    window_blocks = [e[2] for e in effects if e[0] == "alloc" and len(e) == 4 and e[3] == 1]
    if not window_blocks:
        return False
    try:
        engine_effect(state, ("publish", 0, 0, window_blocks[0], 1))
    except Illegal:
        return False
    return True


def spec_takes_let_go() -> bool:
    """Whether the spec lets an engine that registers on its own give up a window block of a
    running request on its own schedule (``dedup`` to the null block: SGLang's window lock moving
    on, its out-of-window frees), and then frees none at schedule itself."""
    from kvspec.spec import apply, initial_state
    from kvspec.spec.observed import engine_effect

    config = hybrid_swa_config(Config(num_blocks=5, block_size=2, policy="engine-registers"))
    state = initial_state(config)
    for decision in (("arrive", 0, (1, 2, 3, 4, 5, 6), 3, 0), ("begin", 0)):
        apply(state, decision)
    apply(state, ("schedule", 0, 2, 0))
    apply(state, ("submit", 0))
    try:
        engine_effect(state, ("dedup", 0, 0, 0, 1))
    except Exception:  # noqa: BLE001 - any refusal of the effect means the spec lacks it
        return False
    return state.requests[0].group_tables[0][:1] == [0]


SWA_REFERENCES = (
    "this spec frees a window group's blocks at schedule and takes no engine's own let-go "
    "(dedup to the null block): SGLang's window lock moves at each insert, so tree pages further "
    "back in a request's row are evictable while it runs: docs/adapters.md, SGLang, hybrid models"
)
"""Why the SWA factories refuse where the spec follows several groups but not the let-go."""


def spec_group() -> Any:
    """The spec's ``Group`` (``Config.groups``), or None while the spec has no groups."""
    import kvspec.spec.state as state

    return getattr(state, "Group", None)


class SglangAdapter:
    judging = "observed"
    supports_loads = False

    def __init__(
        self,
        config: Config,
        choices: Choices,
        overlap: bool = True,
        tree: str = "unified",
        test_retract: bool | None = None,
    ) -> None:
        budget = max(config.token_budget, config.max_running, config.block_size)
        config = replace(config, token_budget=budget)
        if overlap:
            config = replace(config, async_scheduling=True)
        if tree == "swa":
            config = hybrid_swa_config(config)
        if tree in ("mamba", "mamba-extra"):
            config = hybrid_mamba_config(config, extra=tree == "mamba-extra")
        self.config = config
        self.overlap, self.tree, self.test_retract = overlap, tree, test_retract
        self.scheduler = self.new_scheduler(config, choices, overlap)
        self.events: list[Event] = self.scheduler.events
        self._published: set[int] = set()  # for self_check: pages the events registered
        self._seen = 0
        from .kv_stream import attach  # SGLang's own KV-event publisher, judged

        self.kv_stream = attach(self)

    def new_scheduler(self, config: Config, choices: Choices, overlap: bool) -> Scheduler:
        """The scheduler the loops drive (a mutant's subclass overrides this)."""
        return Scheduler(config, choices, overlap, self.tree, self.test_retract)

    # -- the protocol ---------------------------------------------------------------------------

    def add_request(
        self,
        rid: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        priority: int,
        external: bool = False,
    ) -> None:
        if external:
            raise ValueError("the SGLang adapter has no external KV loads")
        self.scheduler.add_request(rid, prompt, max_tokens)

    def step(self) -> bool:
        """One iteration of SGLang's event loop; False when it had nothing to do."""
        return self._overlap_iteration() if self.overlap else self._normal_iteration()

    def _overlap_iteration(self) -> bool:
        s = self.scheduler
        batch, step = s.get_next_batch_to_run()
        if step is not None:
            self.events.append(("submit", step))  # run_batch
            if batch is not None:
                s.forward_ct += 1
                s.result_queue.append((batch.copy(), step))
        processed = s.last_batch is not None
        if processed:
            s.process_batch_result(*s.result_queue.popleft())  # pop_and_process
        elif batch is None:
            s.on_idle()
        if batch is None and step is not None:  # an empty step: only its effects
            self.events += [("execute", step, ()), ("commit", step, ())]
        s.last_batch = batch
        return step is not None or processed

    def _normal_iteration(self) -> bool:
        s = self.scheduler
        batch, step = s.get_next_batch_to_run()
        if step is None:
            s.on_idle()
        else:
            self.events.append(("submit", step))
            if batch is None:
                self.events += [("execute", step, ()), ("commit", step, ())]
            else:
                s.forward_ct += 1  # run_batch
                s.process_batch_result(batch, step)
        s.last_batch = batch
        return step is not None

    def abort(self, rid: int) -> bool:
        return self.scheduler.abort_request(rid)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def live_requests(self) -> list[int]:
        s = self.scheduler
        return [rid for rid in s.requests if rid not in s.gone]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Refcounts: a tree page's ``lock_ref`` (the requests whose locked path holds it) where
        SGLang keeps it on a Python node; over the Rust ``TreeCore``, which says only which tree
        pages are unlocked, an unlocked page counts 0 and a locked one the rows whose protected
        prefix (``cache_protected_len``) holds it. A page outside the tree counts the rows
        holding it past ``cache_protected_len``. Free: the allocator's free pages and the
        unlocked tree pages (evictable, like the spec's cached free blocks)."""
        s, record = self.scheduler, self.scheduler.record
        if s.hybrid_ssm:
            return self._mamba_snapshot()
        refcounts = [0] * self.config.num_blocks
        if s.hybrid_swa:
            free = record.free_pages()  # type: ignore[attr-defined]
        else:
            free = set(int(p) for p in s.allocator.get_all_free_pages().tolist())
        unlocked, locks = record.unlocked(), record.locks()
        protected: dict[int, int] = {}
        for req in s.holders():
            cut = req.kv.cache_protected_len // s.page_size
            for row in record.tables(req):
                for page in row[:cut]:
                    protected[page] = protected.get(page, 0) + 1
                for page in row[cut:]:
                    refcounts[page] += 1
        refcounts[0] = 0  # the null block (an SWA position freed behind the window)
        for page in record.cached_pages():
            if locks is not None:
                refcounts[page] = locks[page]
            elif page not in unlocked:
                refcounts[page] = protected.get(page, 0)
        free |= unlocked
        return tuple(refcounts), tuple(sorted(free))

    def _mamba_snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``snapshot`` over FULL and MAMBA (``mamba.py``): FULL pages as for one group; a
        request's own state slot counts 1 and a tree state 0: a hit copies it and takes no
        reference (``spec/slots.py``), and SGLang's lock on the node of a request's last match
        or insert, which keeps that state from eviction while the request runs, guards a state
        the request never reads again. Free: both allocators' free ids, the unlocked tree pages
        and every tree state (cached, evictable in the spec's sense)."""
        s, record = self.scheduler, self.scheduler.record
        refcounts = [0] * self.config.num_blocks
        holders = s.holders()
        free = record.free_pages()  # type: ignore[attr-defined]
        unlocked = record.unlocked()
        protected: dict[int, int] = {}
        for req in holders:
            row, own = record.tables(req)
            cut = req.kv.cache_protected_len // s.page_size
            for page in row[:cut]:
                protected[page] = protected.get(page, 0) + 1
            for page in row[cut:] + own:
                refcounts[page] += 1
        for page in record.cached_pages():
            if page <= s.full_pages and page not in unlocked:
                refcounts[page] = protected.get(page, 0)
        return tuple(refcounts), tuple(sorted(free | unlocked))

    def check_kv_stream(self, judge: Any) -> Any:
        """The stream SGLang's publisher sent, judged (``kv_stream.py``)."""
        return None if self.kv_stream is None else self.kv_stream.check(judge)

    def self_check(self) -> str | None:
        """Cross-check the wrappers with SGLang's tree: the pages the events registered and did
        not drop (``publish`` less ``evict``, ``unpublish``, ``reset``) are the tree's pages."""
        for event in self.events[self._seen :]:
            if event[0] in ("publish", "snapshot"):
                self._published.add(event[3])  # type: ignore[arg-type]
            elif event[0] in ("evict", "unpublish"):
                self._published.discard(event[1])  # type: ignore[arg-type]
            elif event[0] == "reset":
                self._published.clear()
        self._seen = len(self.events)
        tree = set(self.scheduler.record.cached_pages())
        if tree != self._published:
            return (
                f"SGLang's tree holds pages {sorted(tree)}; the events registered "
                f"{sorted(self._published)}"
            )
        return None
