"""vLLM's scheduler as kvspec events: ``attach(scheduler)``, from vLLM's own entry points.

``attach(scheduler)`` takes a ``Scheduler`` the caller built (the fuzzer's loop, a vLLM test) and
wraps, on that instance only, the methods where the engine core's decisions and the block
lifecycle happen; every call then appends kvspec events (``docs/events.md``) to ``events``:

==================================  ==========================================================
vLLM method                         events
==================================  ==========================================================
``Scheduler.add_request``           ``arrive`` (the request's id mapped to the next integer)
``Scheduler.schedule``              ``begin``, the effects inside, ``submit``
``KVCacheManager.allocate_slots``   ``schedule`` (and ``hit`` on admission) when it succeeds,
                                    then the effects recorded inside it
``BlockPool.get_new_blocks``        ``evict`` (from ``_maybe_evict_cached_block``), ``alloc``
``BlockPool._insert_block_hash``    ``publish``
``Scheduler._preempt_request``      ``preempt`` (called by the caller itself: ``begin``,
                                    ``preempt``, ``submit`` of a step of its own)
``BlockPool.free_blocks``           ``free``, one per block, in the order vLLM frees them
``Scheduler._free_request``         ``finish`` (and ``abort`` first, under ``finish_requests``)
``KVCacheManager.pop_blocks_for_free``  nothing: ``defer_block_free`` holds the blocks; their
                                    ``free`` events come from ``free_blocks`` when drained
``Scheduler.update_from_output``    ``execute`` and ``commit``: the tokens read from the
                                    caller's ``ModelRunnerOutput`` by vLLM's rules (below)
``Scheduler.finish_requests``       ``abort`` per live request, its frees, ``finish ... abort``
``KVCacheManager.reset_prefix_cache``  ``reset`` and an ``unpublish`` per cached block
==================================  ==========================================================

**Outputs.** ``update_from_output`` must get the ``SchedulerOutput`` of the oldest step in flight.
Its ``commit`` lists ``(request, token)`` for the requests vLLM will append a token to: those still
live (vLLM skips finished and aborted ones), and of those preempted while a submitted step held
them (*stale* output, ``num_stale_output_tokens``) only in vLLM's default mode, which delivers it
to the waiting request; its drop mode (``requires_kv_delivery``) drops it. The spec models both
(``Config.stale_output``, read by ``config_of``), and ``AsyncScheduler``'s decodes on placeholders
(``Config.async_scheduling``), and a pool without prefix caching (``Config.prefix_caching``,
read from ``enable_caching``: nothing published, no hits, a table freed as one batch), and
speculative decoding (``Config.spec_tokens``, read from ``num_spec_tokens``), in a ``Scheduler``
or an ``AsyncScheduler``: a request's drafts are its ``scheduled_spec_decode_tokens``, and the commit
lists its sampled tokens, up to its drafts + 1, as many as vLLM appends (it trims after a stop;
``_stops`` reads how many). A token at
which vLLM stops the request (EOS, a stop token, repetition) is reported as the configuration's
``stop_token``: the spec knows one stop token, vLLM decides per request, and the token never
enters a hash (the request finishes with it).

**KV connectors.** A connector of ``features.MODELLED_CONNECTORS`` is judged: a synchronous
load is the ``schedule`` decision's loaded blocks (``allocate_slots``' external tokens) with the
tokens computed after them; an asynchronous one is followed by ``AsyncLoads`` (running to the
spec from its admission, waiting to vLLM until scheduled after ``finished_recving``).

**Other connectors.** An EC connector and an aux output connector are judged
(``features.scheduler_features`` says why): what they can change shows at run time, a delayed
free, an error finish, multimodal inputs, and an aux output connector's bound on the prefix-cache
hit when it cuts the hit short (``_bounded_hit``, at the admission's ``allocate_slots``).

**Arrivals, resets.** Under the priority policy vLLM ranks by ``arrival_time``: with
``hold_arrivals`` (the pytest plugin) the requests added since the last other entry point arrive
to the spec sorted by it when that entry point begins. ``reset_prefix_cache`` preempting running
requests is a step of its own to the spec (``_reset_step``), and so is a preemption the caller
makes itself between a ``schedule()`` and its output (``_lone_preemption``). A request waiting
for its grammar arrives to the spec only once the grammar is compiled (``_release_grammars``).

**Refusals.** Where vLLM's state shows something the spec does not model (``features.py``: any
other KV connector, load failures but a failed asynchronous load under vLLM's ``fail`` policy
(judged: ``_failed_loads``), drafts with lookahead slots, hybrid groups, a sliding window
but one plain group (judged: ``Config.sliding_window``, read by ``config_of``; its skipped frees
inside ``allocate_slots`` are effects of the ``schedule`` decision), CoW retentions, lookahead
hashing, a waiting
request passed over, ...), or a caller does what no engine core does (edits vLLM's state between
calls, drives the KV-cache manager directly, patches a wrapped method, samples a token
mid-prefill), ``refusal`` is set, at attach time or at run time, with the feature's name. The
events go on being recorded; a judge must not judge what comes after a refusal.
``listener(attachment)`` is called whenever an outermost entry point returns: a consistent point,
where the events so far can be judged and the pool compared with the spec's (``snapshot``).

vLLM's native KV events (``BlockStored``/``BlockRemoved``, from ``take_events``) are kept in
``native`` and cross-checked by ``self_check``; disagreements between the wrappers land in
``problems``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request

from kvspec.spec import Config

from . import chunked, versions
from . import groups as hybrid_groups
from .attach_blocks import EVICT_FIRST, BlockCalls
from .attach_outputs import OutputCalls
from .attach_preemption import Preemptions
from .attach_steps import Event, InFlight, StepCalls
from .features import (
    AsyncScheduler,
    Feature,
    pending_features,
    scheduler_features,
    sliding_window_of,
    trims_at_finish,
)
from .methods import Method, Wrappers
from .pool_view import PoolView, read_pool_view
from .versions import MissingName, read

STOP = -1
"""The stop token of ``config_of``'s configuration: no vLLM token id is negative."""
UNBOUNDED = 1 << 30
"""``schedule()`` bounds no steps in flight (the engine core's batch queue does)."""


def guarded(owner: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Run kvspec's own bookkeeping for an attachment (``owner``: its ``error`` and ``refuse``);
    a bug there is recorded and refused as an internal error, never raised into vLLM."""
    try:
        return fn(*args)
    except MissingName as err:  # a vLLM name kvspec reads moved: refused by name (versions.py)
        owner.refuse(err.feature, err.detail)
        return None
    except Exception as err:  # kvspec's bug: the test must not see it
        internal_error(owner, f"{type(err).__name__}: {err} (in {getattr(fn, '__name__', fn)})")
        return None


def internal_error(owner: Any, why: str) -> None:
    """A bug of kvspec met while attached (``guarded``, or a wrapper's, ``methods.Wrappers``):
    the first is kept in ``owner.error``, and judging stops (a refusal as an internal error).
    Once the attachment has refused a feature, judging has already stopped and its bookkeeping
    no longer follows vLLM (the refused feature is why): an error there is kept apart
    (``owner.error_after_refusal``), not counted as kvspec's, and the wrappers step aside."""
    refusal = owner.refusal
    if refusal is not None and refusal.feature != "kvspec internal error":
        if owner.error_after_refusal is None:
            owner.error_after_refusal = why
        return
    if owner.error is None:
        owner.error = why
    owner.refuse("kvspec internal error", owner.error)


@dataclass(frozen=True)
class Refusal:
    """Why an attachment stopped being judgeable: a feature's name and what was seen."""

    feature: str
    detail: str
    at: str
    """``construction`` (seen when attaching) or ``run`` (seen while the caller drove it)."""
    also: tuple[str, ...] = ()
    """At construction, every other feature seen then (``features.scheduler_features`` checks
    them all): what else a test would need before it could be judged."""

    @property
    def features(self) -> tuple[str, ...]:
        """Every feature this refusal names, the one it stopped at first."""
        return (self.feature, *self.also)

    def __str__(self) -> str:
        return f"{self.feature}: {self.detail}" if self.detail else self.feature


@dataclass
class AsyncLoads:
    """Requests the attachment follows through an asynchronous KV load. To the spec such a
    request is running from its load's admission on (``schedule`` with loaded blocks and no
    tokens; the load lands when that step commits); to vLLM it waits
    (``WAITING_FOR_REMOTE_KVS``, then, once ``finished_recving`` named it, waiting with its
    blocks) until a later ``schedule()`` runs it. There ``_update_waiting_for_remote_kv``
    registers the loaded blocks (``cache_blocks``) just before its ``allocate_slots``; the spec
    registers them in that schedule decision (``delay_load_registration``), after its
    allocations, so those publications wait in ``landing`` and go in before the decision's own."""

    waiting: set[str] = field(default_factory=set)
    """Loading or landed, not scheduled yet: running to the spec, waiting to vLLM."""
    alive: set[str] = field(default_factory=set)
    """Admitted with an asynchronous load and not finished: the spec's running order may not
    be vLLM's (vLLM appends the request to running only when it is scheduled after landing)."""
    landing: dict[str, list[Event]] = field(default_factory=dict)
    """The publications of a landed load's blocks, until the request's schedule decision."""

    def start(self, req_id: str) -> None:
        self.waiting.add(req_id)
        self.alive.add(req_id)

    def scheduled(self, req_id: str, effects: list[Event]) -> list[Event]:
        """The landed request's schedule decision came: its effects, the landed publications
        placed where the spec makes them (after the allocations, before the new ones)."""
        self.waiting.discard(req_id)
        landed = self.landing.pop(req_id, [])
        first = next((i for i, e in enumerate(effects) if e[0] == "publish"), len(effects))
        return effects[:first] + landed + effects[first:]

    def forget(self, req_id: str) -> None:
        self.waiting.discard(req_id)
        self.alive.discard(req_id)
        self.landing.pop(req_id, None)


@dataclass
class Attachment(StepCalls, OutputCalls, Preemptions, BlockCalls):
    """vLLM's scheduler attached: its state, the checks around every entry point (``_enter``),
    and the wrappers installed on the instance (``_wrap``), whose bodies are grouped by what they
    wrap: arrivals and steps (``attach_steps.py``), outputs and finishes
    (``attach_outputs.py``), preemptions and resets (``attach_preemption.py``), the KV-cache
    manager's and the pool's calls (``attach_blocks.py``)."""

    scheduler: Any
    config: Config
    on_preempt: Callable[[str], None] = lambda request_id: None
    listener: Callable[[Attachment], None] | None = None
    events: list[Event] = field(default_factory=list)
    native: list[Any] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    refusal: Refusal | None = None
    error: str | None = None
    error_after_refusal: str | None = None
    """kvspec's first error once a feature was refused (``internal_error``): not counted."""
    """A bug of kvspec met inside a wrapper (the wrapped call itself went on)."""
    ids: dict[str, int] = field(default_factory=dict)
    """vLLM request id -> the event stream's integer id, assigned at arrival."""
    hold_arrivals: bool = False
    """Under the priority policy, hold the requests added since the last other entry point and
    let them arrive, ordered by ``arrival_time``, when that entry point begins (``_release``):
    vLLM ranks by ``arrival_time``, the spec by arrival order, so a test may add requests out of
    order. Off (the fuzzer's loop): they arrive at ``add_request``, and an arrival time not after
    an earlier one of its priority is refused."""

    def __post_init__(self) -> None:
        self.kv = self.scheduler.kv_cache_manager
        self.pool = self.kv.block_pool
        self.block_size = self.config.block_size
        self.in_flight: list[InFlight] = []
        self.next_step = 0
        self.depth = 0
        self.entry: str | None = None
        self._current: int | None = None  # request whose slots are being allocated
        self._current_request: Any = None
        self._owner: Any = None  # request whose blocks cache_blocks registers
        self._pending: list[Event] = []  # effects recorded inside allocate_slots
        self._evicted: set[int] = set()
        self._touched: list[int] = []  # blocks vLLM touched inside the current allocate_slots
        self._aborting: set[str] = set()
        self._failing: dict[str, int] = {}
        """Failed asynchronous loads under vLLM's ``fail`` policy, by request id, while the
        output that reports them is processed (``_failed_loads``)."""
        self._finishing: dict[int, str] = {}
        self._lengths: dict[int, tuple[Any, int]] = {}  # rid -> (request, its tokens before)
        self._links: dict[object, object] = {}  # (parent hash, block tokens) -> hash
        self._hashes: dict[object, object] = {}  # hash -> (parent hash, block tokens)
        self._checked: dict[str, int] = {}  # request id -> blocks whose hashes were checked
        self._hit_bounds: dict[str, int | None] = {}  # request id -> its lookup's bound (tokens)
        self._latest: dict[int, float] = {}  # priority -> latest arrival time released
        self._held: list[tuple[float, str, Request, Event]] = []  # (time, id, request, arrive)
        self._grammars: dict[str, tuple[Request, Event]] = {}  # waiting for their grammar
        self._reset_at: int | None = None  # the step of a reset's preemptions, while open
        self._edited: str | None = None  # state the caller edited that later calls would read
        self._dropped: set[str] = set()  # requests whose output in flight a reset dropped
        self._victims: list[str] = []  # the requests the open reset step preempts
        self._hashed_arrival = False  # a request's hasher has set hash_lookahead (_lookahead)
        self._lone_at: int | None = None  # the step of the caller's own preemption, while open
        self._next_id = 0  # the event stream's next request id
        self._reordered = False  # vLLM's cache-aware reorder ran in this schedule() (0.34.0)
        self._admitted: dict[str, int] = {}  # request id -> when the spec admitted it
        self._appended: dict[str, int] = {}  # request id -> when vLLM appended it to running
        self._admissions = 0
        self._extra = 0  # tokens of partial synchronous loads counted as computed this step
        # an output with no token where one was due (_commit): its commit is withheld, and
        # judging ends there if vLLM is driven past it or that output changed a block
        self._unsampled: str | None = None
        self._unsampled_at = 0
        # several KV-cache groups (hybrid.py): each alloc/hit/publish names its group
        self.group_sizes = hybrid_groups.group_block_sizes(self.scheduler)
        self.hybrid = len(self.group_sizes) > 1
        self._group: int | None = None  # the group whose manager is working, when hybrid
        self._windowed = (
            self.config.sliding_window is not None
            or chunked.one_chunked_group(self.scheduler) is not None
            or hybrid_groups.frees_skipped_blocks(self.scheduler)
        )
        self.loads = AsyncLoads()
        self.wrappers = Wrappers()
        self.wrappers.on_bypass = lambda why: self.refuse("vLLM method patched by the test", why)
        self.wrappers.on_error = lambda why: internal_error(self, why)
        # A test may answer these itself (methods.py): an allocation that failed, vLLM's
        # scheduler then taking its failure path; a reset's reply, to the scheduler only.
        self.wrappers.answerable[(id(self.kv), "allocate_slots")] = lambda got: got is None
        self.wrappers.answerable[(id(self.kv), "reset_prefix_cache")] = lambda got: (
            type(got) is bool
        )
        self.wrappers.snapshot = self.fingerprint
        try:
            self._wrap()
            try:
                found = scheduler_features(self.scheduler)
            except MissingName as err:
                found = [(err.feature, err.detail)]
            if found:
                (feature, detail), others = found[0], tuple(name for name, _ in found[1:])
                self.refuse(feature, detail, at="construction", also=others)
            self._fingerprint = self.fingerprint()
        except BaseException:  # no half-made attachment stays on vLLM's objects
            self.wrappers.uninstall()
            raise

    # -- public -------------------------------------------------------------------------------

    def refuse(
        self, feature: str, detail: str = "", at: str = "run", also: tuple[str, ...] = ()
    ) -> None:
        """Stop being judgeable (the first refusal is kept)."""
        if self.refusal is None:
            others = tuple(dict.fromkeys(f for f in also if f != feature))
            self.refusal = Refusal(feature, detail, at, others)

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(refcount of every block, null block as 0; the free queue head first)."""
        refcounts = (0,) + tuple(b.ref_cnt for b in self.pool.blocks[1:])
        free = tuple(b.block_id for b in self.pool.free_block_queue.get_all_free_blocks())
        return refcounts, free

    def pool_view(self) -> PoolView | None:
        """vLLM's own hash index and free / evictable accounting (``pool_view.py``)."""
        groups = len(self.scheduler.kv_cache_config.kv_cache_groups)
        return read_pool_view(self.pool, groups)

    def self_check(self) -> str | None:
        """Cross-check the wrapped methods against vLLM's own KV events: as many blocks stored
        as ``publish`` events, as many removed as ``evict`` events."""
        if self.problems:
            return self.problems[0]
        if not self.pool.enable_kv_cache_events:
            return None  # vLLM records no KV events to compare with
        # Peek at the events vLLM has not taken yet: taking them would keep them from its publisher.
        native = self.native + list(self.pool.kv_event_queue)
        stored = sum(len(e.block_hashes) for e in native if isinstance(e, BlockStored))
        removed = sum(len(e.block_hashes) for e in native if isinstance(e, BlockRemoved))
        published = sum(1 for e in self.events if e[0] == "publish")
        dropped = sum(1 for e in self.events if e[0] == "evict")
        if stored != published or removed != dropped:
            return (
                f"vLLM's KV events stored {stored} and removed {removed} blocks; the wrapped "
                f"methods saw {published} publications and {dropped} evictions"
            )
        return None

    def detach(self) -> None:
        self.wrappers.uninstall()

    def fingerprint(self) -> tuple[object, ...]:
        """What the spec models of vLLM's state, to tell whether the caller changed it between
        two entry points."""
        sched, pool = self.scheduler, self.pool
        requests = tuple(
            (
                rid,
                r.status,
                r.num_computed_tokens,
                r.num_tokens,
                r.max_tokens,
                # fcfs never reads a priority (its queue and its victim ignore it)
                r.priority if self.config.preemption == "priority" else None,
                r.num_output_placeholders,
                r.num_stale_output_tokens,
            )
            for rid, r in sched.requests.items()
        )
        tables = tuple(
            (rid, tuple(b.block_id for b in blocks))
            for manager in self.kv.coordinator.single_type_managers
            for rid, blocks in manager.req_to_blocks.items()
        )
        queue = pool.free_block_queue
        free: tuple[int, ...] | int = queue.num_free_blocks
        if len(pool.blocks) <= 4096:
            free = tuple(b.block_id for b in queue.get_all_free_blocks())
        return (
            requests,
            tuple(r.request_id for r in sched.running),
            len(sched.waiting),
            tables,
            tuple(b.ref_cnt for b in pool.blocks),
            free,
            len(pool.cached_block_hash_to_block),
        )

    # -- entry points -------------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        """An outermost entry point begins: refuse what changed since the last one returned."""
        self.depth, self.entry = 1, name
        if name != "add_request" and self._held:
            self._release()
        if self._grammars:
            self._release_grammars()
        if self.refusal is not None:
            return
        if self._unsampled is not None:
            return self.refuse("no token sampled", f"{self._unsampled}; driven past it")
        why = self.wrappers.tampered()
        if why is not None:
            return self.refuse("vLLM method patched by the test", why)
        if self.scheduler.kv_cache_manager is not self.kv or self.kv.block_pool is not self.pool:
            return self.refuse("KV cache manager replaced", "after construction")
        if self.fingerprint() != self._fingerprint:
            return self.refuse("state edited between calls", f"before {name}()")
        if self._edited is not None:  # set where a call judged had it edited (a reset's)
            return self.refuse("state edited between calls", f"{self._edited}, before {name}()")
        for feature in scheduler_features(self.scheduler) + pending_features(
            self.scheduler,
            scheduling=name == "schedule",
            loaders=self.loads.waiting,
            held=self._grammars,
            dropped=self._dropped_by_reset(),
        ):
            return self.refuse(*feature)
        now = config_of(self.scheduler)
        deferral = (now.defer_free, now.defer_loads)
        if deferral != (self.config.defer_free, self.config.defer_loads) and not self.events:
            # set after construction (vLLM's tests do), before anything happened: the
            # configuration the scheduler is judged against from its first event on
            self.config = replace(self.config, defer_free=deferral[0], defer_loads=deferral[1])
        drift = _drift(self.config, now)
        if drift:
            self.refuse("scheduler limits changed", drift)

    def _exit(self) -> None:
        self.depth, self.entry = 0, None
        if self.refusal is None:
            self._fingerprint = self.fingerprint()
        if self.listener is not None:
            self.listener(self)

    def _outermost(self, name: str, body: Callable[[], Any]) -> Any:
        """Run an entry point's ``body`` with the checks around it; vLLM's exceptions pass
        through (and refuse: its state is then whatever vLLM left)."""
        if self.depth:
            return body()
        self._safe(self._enter, name)
        try:
            result = body()
        except BaseException as err:
            self.refuse("vLLM raised", f"{type(err).__name__} in {name}()")
            self.depth, self.entry = 0, None
            raise
        self._safe(self._exit)
        return result

    def _safe(self, fn: Callable[..., Any], *args: Any) -> Any:
        return guarded(self, fn, *args)

    def _inner(self, what: str) -> None:
        """A wrapped method below the entry points, called outside them."""
        if self.depth == 0:
            self.refuse("KV cache manager driven directly", f"{what} outside the scheduler")

    # -- the wrappers -------------------------------------------------------------------------

    def _wrap(self) -> None:
        sched, kv, pool, w = self.scheduler, self.kv, self.pool, self.wrappers
        for obj, name, make in (
            (sched, "add_request", self._add_request),
            (sched, "schedule", self._schedule),
            (sched, "update_from_output", self._update_from_output),
            (sched, "finish_requests", self._finish_requests),
            (sched, "reset_prefix_cache", self._scheduler_reset),
            (sched, "_preempt_request", self._preempt_request),
            (sched, "_free_request", self._free_request),
            (
                sched,
                "_free_cow_retained_blocks",
                self._refusing("CoW retained blocks", "_free_cow_retained_blocks"),
            ),
            (kv, "pop_blocks_for_free", self._pop_blocks_for_free),
            *(
                [(sched, "_reorder_waiting_by_cached_prefix", self._reorder)]
                if self.config.admission_window
                else []
            ),
            (sched, "_reserve_prefill_lookahead", self._prefill_lookahead),
            (kv, "get_computed_blocks", self._get_computed_blocks),
            (kv, "allocate_slots", self._allocate_slots),
            (kv, "cache_blocks", self._cache_blocks),
            (kv, "take_events", self._take_events),
            (kv, "reset_prefix_cache", self._kv_reset),
            (pool, "get_new_blocks", self._get_new_blocks),
            (pool, "touch", self._touch),
            (pool, "_maybe_evict_cached_block", self._evict),
            (pool, "_insert_block_hash", self._insert),
            (pool, "free_blocks", self._free_blocks),
        ):
            w.install(obj, name, make)
        if self.hybrid:
            hybrid_groups.wrap_managers(self)
        for obj, name, feature in (
            (kv, "evict_blocks", "eviction by block id"),
            (pool, "evict_blocks", "eviction by block id"),
            (pool, "cache_partial_block", "partial prefix-cache hits"),
            (pool, "move_block_hashes", "hashes moved between blocks"),
            (pool, "unpin_blocks", "blocks released while read"),
        ):
            w.install(obj, name, self._refusing(feature, name))

    def _refusing(self, feature: str, name: str) -> Callable[[Method], Method]:
        def make(original: Method) -> Method:
            def wrapper(*args: Any, **kw: Any) -> Any:
                self.refuse(feature, f"{name}()")
                return original(*args, **kw)

            return wrapper

        return make


def config_of(scheduler: Any, depth: int = UNBOUNDED, stop_token: int | None = STOP) -> Config:
    """The spec configuration a vLLM ``Scheduler`` claims to implement: its pool, block size,
    preemption policy, token budget and admission limit, async scheduling (an
    ``AsyncScheduler``) and what becomes of stale output (dropped where ``requires_kv_delivery``,
    else delivered), whether frees wait for the steps in flight (``defer_block_free``) and
    asynchronous loads too (``defer_async_loads``, which vLLM sets only beside it); vLLM
    0.33.0 and 0.34.0 register eagerly."""
    priority = scheduler.policy == SchedulingPolicy.PRIORITY
    asynchronous = AsyncScheduler is not None and isinstance(scheduler, AsyncScheduler)
    return Config(
        num_blocks=scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
        block_size=scheduler.block_size,
        depth=depth,
        policy="eager-unsafe",
        discipline="vllm",
        preemption="priority" if priority else "fcfs",
        token_budget=scheduler.max_num_scheduled_tokens,
        max_running=scheduler.max_num_active_reqs,
        stop_token=stop_token,
        async_scheduling=asynchronous,
        stale_output="drop" if scheduler.requires_kv_delivery else "deliver",
        prefix_caching=bool(scheduler.kv_cache_manager.enable_caching),
        spec_tokens=int(read(scheduler, "num_spec_tokens") or 0),
        delay_load_registration=scheduler.connector is not None,
        defer_free=bool(read(scheduler, "defer_block_free")),
        sliding_window=sliding_window_of(scheduler),
        trim_at_finish=trims_at_finish(scheduler),
        defer_loads=bool(read(scheduler, "defer_async_loads"))
        and bool(read(scheduler, "defer_block_free")),
        admission_window=versions.admission_window(scheduler),
        admission_threshold=versions.admission_threshold(scheduler),
        **hybrid_groups.spec_groups(scheduler),
        **chunked.spec_groups(scheduler),
    )


def attach(
    scheduler: Any,
    config: Config | None = None,
    on_preempt: Callable[[str], None] = lambda request_id: None,
    listener: Callable[[Attachment], None] | None = None,
    hold_arrivals: bool = False,
) -> Attachment:
    """Attach to a ``Scheduler`` the caller built: events from now on (``Attachment``).
    ``config`` defaults to ``config_of(scheduler)``; ``on_preempt`` hears of each preemption
    (the fuzzer's runner marks that request's in-flight output stale)."""
    missing: MissingName | None = None
    if config is None:
        try:
            config = config_of(scheduler)
        except MissingName as err:  # refused by name, judged against nothing
            missing = err
            config = Config(
                num_blocks=scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
                block_size=scheduler.block_size,
                policy="eager-unsafe",
            )
    attachment = Attachment(scheduler, config, on_preempt, listener, hold_arrivals=hold_arrivals)
    if missing is not None:
        attachment.refusal = None
        attachment.refuse(missing.feature, missing.detail, at="construction")
    return attachment


def _drift(claimed: Config, now: Config) -> str:
    """Which of the scheduler's limits differ from the configuration judged against."""
    names = ("num_blocks", "block_size", "preemption", "token_budget", "max_running")
    names += ("stale_output", "prefix_caching", "spec_tokens", "defer_free", "sliding_window")
    names += ("defer_loads", "admission_window", "admission_threshold")
    return ", ".join(
        f"{n} {getattr(claimed, n)} -> {getattr(now, n)}"
        for n in names
        if getattr(claimed, n) != getattr(now, n)
    )


__all__ = [
    "EVICT_FIRST",
    "Attachment",
    "Event",
    "Feature",
    "InFlight",
    "Refusal",
    "STOP",
    "attach",
    "config_of",
]
