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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request, RequestStatus

from kvspec.spec import Config
from kvspec.spec.actions import loadable

from . import groups as hybrid_groups
from . import versions
from .features import (
    AsyncScheduler,
    Feature,
    grammar_ready,
    hasher_lookahead,
    lora_skips,
    passed_over,
    pending_features,
    request_features,
    scheduler_features,
    skipped_read,
    sliding_window_of,
)
from .methods import Method, Wrappers
from .pool_view import PoolView, read_pool_view
from .versions import MissingName, evict_first, output_index, read

Event = tuple[object, ...]

STOP = -1
"""The stop token of ``config_of``'s configuration: no vLLM token id is negative."""
UNBOUNDED = 1 << 30
"""``schedule()`` bounds no steps in flight (the engine core's batch queue does)."""

REASONS = {
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_REPETITION: "stop",
    RequestStatus.FINISHED_ABORTED: "abort",
}


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


EVICT_FIRST = ("freed cached blocks to the free queue's head", "free_blocks(evict_first=True)")
"""vLLM 0.34.0's ``free_blocks(..., evict_first=True)``: not the spec's free order."""


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
class InFlight:
    step: int
    output: Any
    samples: dict[str, bool]
    """Request id -> whether its chunk reached the end of its known tokens (it samples)."""


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
class Attachment:
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
        self._latest: dict[int, float] = {}  # priority -> latest arrival time released
        self._held: list[tuple[float, str, Request, Event]] = []  # (time, id, request, arrive)
        self._grammars: dict[str, tuple[Request, Event]] = {}  # waiting for their grammar
        self._reset_at: int | None = None  # the step of a reset's preemptions, while open
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
        for feature in scheduler_features(self.scheduler) + pending_features(
            self.scheduler,
            scheduling=name == "schedule",
            loaders=self.loads.waiting,
            held=self._grammars,
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

    def _add_request(self, original: Method) -> Method:
        def add_request(request: Request, *args: Any, **kw: Any) -> None:
            self._outermost(
                "add_request",
                lambda: (self._safe(self._arrive, request), original(request, *args, **kw))[1],
            )

        return add_request

    def _arrive(self, request: Request) -> None:
        for feature in request_features(self.scheduler, request):
            self.refuse(*feature)
            if feature[0] == "streaming input" or request.prompt_token_ids is None:
                return
            break
        self._lookahead(request)
        self._check_hashes(request, len(request.block_hashes))
        room = self.scheduler.max_model_len - request.num_prompt_tokens
        max_tokens = min(request.max_tokens, room)
        prompt = tuple(request.prompt_token_ids)
        event: Event = ("arrive", None, prompt, max_tokens, request.priority)
        if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and not (
            grammar_ready(request)
        ):
            self._grammars[request.request_id] = (request, event)
            return
        self._queue(request, event)

    def _queue(self, request: Request, event: Event) -> None:
        if self.config.preemption != "priority":
            return self._arrived(request, event)
        t, priority = request.arrival_time, request.priority
        latest = self._latest.get(priority)
        # vLLM ranks equal (priority, arrival_time) by request id, but picks its preemption
        # victim by (priority, arrival_time) alone: equal times are refused.
        tied = any(r.priority == priority and h == t for h, _, r, _ in self._held)
        if (latest is not None and t <= latest) or tied:
            self.refuse(
                "arrival times out of order",
                f"{request.request_id} arrives at {t}, after or beside one at {latest or t}",
            )
        if not (self.hold_arrivals and self.entry == "add_request"):  # not nested in another
            self._latest[priority] = t if latest is None else max(latest, t)
            return self._arrived(request, event)
        self._held.append((t, request.request_id, request, event))

    def _arrived(self, request: Request, event: Event) -> None:
        # An id vLLM has forgotten (its request finished) may come back: a new request to the
        # spec, so a new integer (the mapping names the latest).
        rid = self._next_id
        self._next_id += 1
        self.ids[request.request_id] = rid
        self.events.append((event[0], rid, *event[2:]))

    def _release(self) -> None:
        """The requests held since the last other entry point arrive, by ``arrival_time``
        (``hold_arrivals``): the spec's arrival order is then vLLM's rank among equal
        priorities. Nothing happened to them in vLLM meanwhile (``add_request`` only queues)."""
        held, self._held = sorted(self._held, key=lambda h: h[:2]), []
        for t, _, request, event in held:
            latest = self._latest.get(request.priority)
            self._latest[request.priority] = t if latest is None else max(latest, t)
            self._arrived(request, event)

    def _release_grammars(self) -> None:
        """A request waiting for its grammar is kept from the spec until the grammar is
        compiled: until then vLLM passes it over (``skip_request``) as if it were not there (it
        holds no block, counts toward no limit). Each pass puts the requests it passed over
        back at the head of ``waiting`` in their order, so under fcfs vLLM's queue then agrees
        with the spec's only where every request behind it is still kept from the spec too;
        under the priority policy it is ranked by ``arrival_time`` like any arrival (``_queue``
        refuses one not after a released one of its priority). A request that leaves before
        (a grammar that failed finishes in error) never arrives."""
        requests = self.scheduler.requests
        for req_id, (request, event) in list(self._grammars.items()):
            if requests.get(req_id) is not request or request.is_finished():
                del self._grammars[req_id]
                continue
            blocked = request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            if blocked and not grammar_ready(request):
                continue
            del self._grammars[req_id]
            if self.config.preemption != "priority":
                queue = list(self.scheduler.waiting)
                behind = queue[queue.index(request) + 1 :] if request in queue else [None]
                known = [r for r in behind if r is None or r.request_id not in self._grammars]
                if known:
                    who = known[0].request_id if known[0] is not None else "off the queue"
                    self.refuse("blocked waiting request", f"{req_id}'s grammar ready before {who}")
            self._queue(request, event)

    def _schedule(self, original: Method) -> Method:
        def schedule(*args: Any, **kw: Any) -> Any:
            def body() -> Any:
                step = self.next_step
                self.next_step += 1
                self.events.append(("begin", step))
                self._reordered = False
                output = original(*args, **kw)
                if self.config.admission_window and not self._reordered:
                    if not getattr(output, "preempted_req_ids", None):  # deferred prefills
                        self.refuse("cache-aware admission", "a step that did not reorder")
                if self.loads.landing:
                    self.refuse(
                        "KV connector: a landed load not scheduled at once",
                        ", ".join(self.loads.landing),
                    )
                self.events.append(("submit", step))
                self._safe(self._submitted, step, output)
                return output

            return self._outermost("schedule", body)

        return schedule

    def _reorder(self, original: Method) -> Method:
        """Cache-aware admission (0.34.0): the spec reorders its own queue by the rule
        (``spec/admission.py``) at the step's first admission; this notes that vLLM reordered
        in this step (it does not where it defers prefills: refused in ``schedule``). Called
        from anywhere but ``schedule()`` (a test driving it), vLLM's queue changes where the
        spec's does not: refused."""

        def reorder(*args: Any, **kw: Any) -> Any:
            if self.entry != "schedule":
                self.refuse("cache-aware admission", "the reorder called outside schedule()")
            self._reordered = True
            return original(*args, **kw)

        return reorder

    def _submitted(self, step: int, output: Any) -> None:
        requests = self.scheduler.requests
        extra, self._extra = self._extra, 0
        if output.total_num_scheduled_tokens + extra > self.config.token_budget:
            self.refuse(
                "KV connector: a load not of whole blocks",
                f"its tail computed to the spec overruns step {step}'s token budget",
            )
        samples = {r: not requests[r].is_prefill_chunk for r in output.num_scheduled_tokens}
        self.in_flight.append(InFlight(step, output, samples))
        for req_id, drafts in output.scheduled_spec_decode_tokens.items():
            request = requests.get(req_id)
            past = request.num_computed_tokens - request.num_tokens if request else -1
            if request is not None and self.config.async_scheduling:
                # AsyncScheduler has just counted this decode's own token and its drafts among
                # the placeholders: the drafts reach exactly past the others'
                past -= request.num_output_placeholders - 1 - len(drafts)
            if not self.config.spec_tokens or len(drafts) != past:
                self.refuse("speculative decoding", f"{len(drafts)} draft tokens for {req_id}")

    def _update_from_output(self, original: Method) -> Method:
        def update_from_output(
            scheduler_output: Any, model_runner_output: Any, *args: Any, **kw: Any
        ) -> Any:
            def body() -> Any:
                at = self._safe(self._commit, scheduler_output, model_runner_output)
                self._finishing = {}
                try:
                    result = original(scheduler_output, model_runner_output, *args, **kw)
                finally:
                    failing, self._failing = self._failing, {}
                if at is not None:
                    self._safe(self._stops, at)
                    self._safe(self._failed_finished, failing)
                self._safe(self._withhold_commit)
                return result

            return self._outermost("update_from_output", body)

        return update_from_output

    def _commit(self, output: Any, runner: Any) -> int | None:
        """Append ``execute`` and ``commit`` for the oldest step; return the commit's index."""
        found = next((i for i, f in enumerate(self.in_flight) if f.output is output), None)
        if found is None:
            self.refuse("an output schedule() did not make", "update_from_output")
            return None
        while found and not self.in_flight[0].output.num_scheduled_tokens:
            # An empty step whose output the caller never processed (a test's last schedule()
            # of a round): it holds no request, so nothing is out of order, and its commit
            # changes nothing the spec models; it commits before the output processed now.
            skipped = self.in_flight.pop(0)
            self.events += [("execute", skipped.step, ()), ("commit", skipped.step, ())]
            found -= 1
        if found != 0:
            self.refuse("outputs processed out of order", f"step {self.in_flight[found].step}")
        oldest = self.in_flight.pop(found)
        sampled: list[tuple[int, int]] = []
        requests = self.scheduler.requests
        tokens_of = runner.sampled_token_ids or []
        index = output_index(runner)
        transfers = runner.kv_connector_output
        if transfers is not None:
            failed = self._failed_loads(output, transfers)
            if transfers.finished_sending:
                self.refuse("KV connector: finished sends", "blocks held while sent")
            for req_id in transfers.finished_recving or ():
                if req_id not in self.loads.waiting:
                    self.refuse("KV connector: a load landing for no loading request", req_id)
        if runner.pooler_output:
            self.refuse("pooling", "pooler output")
        unsampled: list[str] = []
        for req_id in output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.is_finished():
                continue  # vLLM skips requests finished or aborted since
            got = (
                tokens_of[index[req_id]]
                if req_id in index and index[req_id] < len(tokens_of)
                else []
            )
            got = list(got) if got is not None else []
            # Preempted while this step held it: vLLM drops the output in drop mode, else
            # delivers it to the waiting request (the spec's two stale-output modes).
            if request.num_stale_output_tokens > 0 and request.drop_stale_output:
                continue
            wants = oldest.samples.get(req_id, False)
            drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            if len(got) > 1 + drafts:
                self.refuse("several tokens in a step", f"{len(got)} for {req_id}, {drafts} drafts")
            elif got and not wants:
                self.refuse("a token sampled mid-prefill", f"{req_id} (a real runner samples none)")
            elif wants and not got:
                unsampled.append(req_id)
            rid = self.ids[req_id]
            sampled += [(rid, int(token)) for token in got[: 1 + drafts]]
            if len(got) > 1:  # accepted drafts: how many vLLM appends is read after it ran
                self._lengths[rid] = (request, request.num_tokens)
        self.events.append(("execute", oldest.step, failed if transfers is not None else ()))
        if unsampled:  # no commit the spec can take: withheld (_withhold_commit)
            self._unsampled = f"{', '.join(unsampled)} reached the end of its tokens"
            self._unsampled_at = len(self.events)
            return None
        self.events.append(("commit", oldest.step, tuple(sampled)))
        return len(self.events) - 1

    def _failed_loads(self, output: Any, transfers: Any) -> tuple[int, ...]:
        """The requests whose asynchronous load the output reports failed, judged where vLLM's
        ``fail`` policy is the spec's failed load followed by an abort of its request
        (``docs/adapters.md``, "Load failures"): the step only loads (no other request's finish
        comes before the failed one's, as vLLM orders them), the failed request holds at most
        one unregistered block (vLLM frees its table as one batch, the spec one block at a time:
        the same queue with one unhashed block), nothing defers the free, and the worker reports
        the load finished too (else vLLM keeps the blocks). Anything else is refused by name."""
        failed_ids = set(transfers.failed_recving or ())
        if transfers.invalid_block_ids:
            self.refuse("KV connector: load failures", "invalid_block_ids (block-level)")
        if not failed_ids:
            return ()
        if self.scheduler.recompute_kv_load_failures:
            self.refuse("KV connector: load failures", "kv_load_failure_policy recompute")
            return ()
        if output.num_scheduled_tokens or self.config.defer_free:
            self.refuse("KV connector: load failures", "a failed load beside computed requests")
            return ()
        if not failed_ids <= set(transfers.finished_recving or ()):
            self.refuse("KV connector: load failures", "failed_recving not in finished_recving")
            return ()
        manager, pool = self.scheduler.kv_cache_manager, self.pool
        for req_id in sorted(failed_ids):
            if req_id not in self.loads.waiting or req_id not in self.ids:
                self.refuse("KV connector: a load landing for no loading request", req_id)
                return ()
            (table,) = manager.get_block_ids(req_id)
            if sum(1 for b in table if pool.blocks[b].block_hash is None) > 1:
                self.refuse(
                    "KV connector: load failures",
                    f"{req_id}'s failed load holds several unregistered blocks",
                )
                return ()
            self._failing[req_id] = self.ids[req_id]
        return tuple(sorted(self._failing.values()))

    def _failed_finished(self, failing: dict[str, int]) -> None:
        """After vLLM's ``fail`` policy ended the failed loads' requests (an error finish, the
        blocks freed when the load's ``finished_recving`` is handled, after the step's other
        finishes): the spec's ``load_failed`` closes its commit's effects, then the request is
        aborted (``_failed_loads``)."""
        for req_id, rid in failing.items():
            request = self.scheduler.requests.get(req_id)
            if request is not None:
                self.refuse("KV connector: load failures", f"{req_id} keeps its blocks")
                return
            self.events += [("load_failed", rid), ("abort", rid), ("finish", rid, "abort")]

    def _withhold_commit(self) -> None:
        """A runner output with no token for a request at the end of its tokens (no real runner
        makes one; vLLM's tests do, to see the scheduler survive it): the spec's ``commit``
        needs a token, so the step stays executed and uncommitted to the spec. What vLLM did
        before it was judged; the output itself is judged as far as blocks go: it must change
        none (no effect recorded while vLLM processed it), and vLLM driven past it at all ends
        judging ("no token sampled", at the next entry point)."""
        if self._unsampled is not None and len(self.events) != self._unsampled_at:
            self.refuse("no token sampled", f"{self._unsampled}, and the output changed blocks")

    def _stops(self, at: int) -> None:
        """A token at which vLLM stopped its request is the spec's stop token."""
        kind, step, sampled = self.events[at]
        fixed: list[tuple[int, int]] = []
        kept = {  # with accepted drafts vLLM appends a request's tokens up to its stop
            rid: request.num_tokens - before for rid, (request, before) in self._lengths.items()
        }
        self._lengths = {}
        for rid, n in kept.items():
            if n < 1:
                self.refuse("sampled tokens not appended", f"r{rid}: vLLM appended none")
        for rid, token in sampled:  # type: ignore[attr-defined]
            done, limit = sum(1 for r, _ in fixed if r == rid), kept.get(rid)
            if limit is not None and 0 < limit <= done:
                continue  # trimmed by vLLM after its stop
            stopped = self._finishing.get(rid) == "stop" and (limit is None or done + 1 == limit)
            if stopped and token != self.config.stop_token:
                if self.config.stop_token is None:
                    self.refuse("a stop the spec cannot express", f"r{rid} stops at {token}")
                else:
                    token = self.config.stop_token
            elif not stopped and token == self.config.stop_token:
                self.refuse("a stop token that does not stop", f"r{rid} samples {token}")
            fixed.append((rid, token))
        self.events[at] = (kind, step, tuple(fixed))

    def _finish_requests(self, original: Method) -> Method:
        def finish_requests(request_ids: Any, finished_status: Any, *args: Any, **kw: Any) -> Any:
            if self.depth:  # inside update_from_output: vLLM's own error path
                ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
                known = set(self._grammars) | set(self._failing)
                if request_ids is None or any(r not in known for r in ids):
                    self.refuse("request errors", f"finish_requests({finished_status}) by vLLM")
                # a failed grammar's request, kept from the spec: it leaves unseen
                return original(request_ids, finished_status, *args, **kw)

            def body() -> Any:
                self._safe(self._mark_aborts, request_ids)
                try:
                    return original(request_ids, finished_status, *args, **kw)
                finally:
                    self._aborting = set()

            return self._outermost("finish_requests", body)

        return finish_requests

    def _mark_aborts(self, request_ids: Any) -> None:
        requests = self.scheduler.requests
        if request_ids is None:
            ids: Iterable[str] = list(requests)
        elif isinstance(request_ids, str):
            ids = (request_ids,)
        else:
            ids = list(request_ids)
        self._aborting = {
            r for r in ids if r in requests and not requests[r].is_finished() and r in self.ids
        }

    def _scheduler_reset(self, original: Method) -> Method:
        def reset_prefix_cache(*args: Any, **kw: Any) -> Any:
            running = kw.get("reset_running_requests", args[0] if args else False)

            def body() -> Any:
                if running and self.scheduler.running:
                    self._safe(self._reset_step)
                try:
                    return original(*args, **kw)
                finally:
                    self._safe(self._close_reset_step)

            return self._outermost("reset_prefix_cache", body)

        return reset_prefix_cache

    def _reset_step(self) -> None:
        """``reset_prefix_cache(reset_running_requests=True)`` preempts every running request,
        the tail of ``running`` first, then resets the cache. To the spec that is a step of
        its own: ``begin``, the preemptions (vLLM's ``_preempt_request``, wrapped), then
        ``submit``, ``execute`` and ``commit`` of an empty batch before the ``reset``
        (``_close_reset_step``). It matches vLLM only with no step in flight (vLLM drops their
        output for these requests whatever its mode; the spec's ``reset`` needs none in flight
        anyway) and, under the priority policy, where the tail of ``running`` is always its
        largest (priority, arrival), the spec's victim."""
        running = list(self.scheduler.running)
        if self.in_flight:
            self.refuse(
                "reset preempting running requests", f"{len(self.in_flight)} steps in flight"
            )
        if self.config.preemption == "priority":
            ranks = [(r.priority, self.ids.get(r.request_id, -1)) for r in running]
            if ranks != sorted(ranks):
                self.refuse("reset preempting running requests", "not in priority order")
        step = self.next_step
        self.next_step += 1
        self._reset_at = step
        self.events.append(("begin", step))

    def _close_reset_step(self) -> None:
        step, self._reset_at = self._reset_at, None
        if step is not None:
            self.events += [("submit", step), ("execute", step, ()), ("commit", step, ())]

    def _kv_reset(self, original: Method) -> Method:
        def reset_prefix_cache(*args: Any, **kw: Any) -> bool:
            def body() -> bool:
                self._close_reset_step()  # the preemptions' step ends before the reset
                cached = sorted(b.block_id for b in self.pool.blocks if b.block_hash is not None)
                done = bool(original(*args, **kw))
                if done:
                    if self.in_flight:
                        self.refuse("reset with steps in flight", f"{len(self.in_flight)} steps")
                    self.events.append(("reset",))
                    self.events.extend(("unpublish", block) for block in cached)
                return done

            return self._outermost("reset_prefix_cache", body)  # type: ignore[no-any-return]

        return reset_prefix_cache

    def _preempt_request(self, original: Method) -> Method:
        def preempt(request: Request, *args: Any, **kw: Any) -> None:
            if self.depth == 0:  # the test's own preemption: a step of its own, or refused
                self._safe(self._lone_preemption, request)
                try:
                    return self._record_preempt(original, request, *args, **kw)
                except BaseException as err:
                    self.refuse("vLLM raised", f"{type(err).__name__} in _preempt_request()")
                    raise
                finally:
                    self._safe(self._close_lone_preemption)
            if self.entry != "schedule" and self._reset_at is None:
                self.refuse("preemption outside schedule()", f"in {self.entry}")
            return self._record_preempt(original, request, *args, **kw)

        return preempt

    def _record_preempt(self, original: Method, request: Request, *args: Any, **kw: Any) -> None:
        if self.loads.alive:  # the spec runs a loading request, vLLM keeps it waiting
            self._safe(self._victim_beside_loads, request)
        rid = self.ids.get(request.request_id)
        self.events.append(("preempt", rid))
        self.on_preempt(request.request_id)
        original(request, *args, **kw)

    def _victim_beside_loads(self, victim: Request) -> None:
        """A preemption while a request admitted with an asynchronous load is alive. The spec
        runs such a request from its load's admission on; vLLM appends it to ``running`` only
        when it is scheduled after landing, so the two rank their running requests
        differently, and only the choice of a victim depends on that. By vLLM's rule the
        victim is the last appended to ``running`` (fcfs) or the largest (priority, arrival),
        of its running requests (the victim among them: vLLM has just taken it off); by the
        spec's, the last admitted or the largest of those and the loads not scheduled yet.
        Where the two rules pick one request the preemption is judged (a victim vLLM chose
        otherwise is the spec's to find); where they pick two, refused."""
        running = {r.request_id for r in self.scheduler.running} | {victim.request_id}
        candidates = running | self.loads.waiting
        if self.config.preemption == "priority":
            requests, ids = self.scheduler.requests, self.ids
            ranks = {r: (requests[r].priority, ids.get(r, -1)) for r in candidates}
            vllm_rule = max(running, key=ranks.__getitem__)
            spec_rule = max(candidates, key=ranks.__getitem__)
        else:
            vllm_rule = max(running, key=lambda r: self._appended.get(r, -1))
            spec_rule = max(candidates, key=lambda r: self._admitted.get(r, -1))
        if vllm_rule != spec_rule:
            self.refuse(
                "KV connector: preemption beside an asynchronous load",
                f"vLLM's rule preempts {vllm_rule}, the spec's {spec_rule}",
            )

    def _lone_preemption(self, request: Request) -> None:
        """The caller preempts a request itself, outside ``schedule()`` (vLLM's tests do, between
        a ``schedule()`` and its output: popping it from ``running``, then ``_preempt_request``,
        as ``schedule()`` does). To the spec that is a step of its own (``begin``, the
        ``preempt``, ``submit``; its empty batch executes and commits when the steps before it
        have, ``_commit``), which matches vLLM where the request popped is the one ``schedule()``
        would preempt: under fcfs the tail of ``running``, under the priority policy its
        largest (priority, arrival). Refused otherwise, where anything else changed since the
        last entry point, and where its free would be deferred (``defer_block_free`` with a
        step in flight: vLLM's ``schedule()`` never preempts such a request)."""
        self.depth, self.entry = 1, "_preempt_request"
        if self._held:
            self._release()
        if self.refusal is not None:
            return
        sched, rid = self.scheduler, request.request_id
        before, now = self._fingerprint, self.fingerprint()
        running = tuple(r.request_id for r in sched.running)
        was = before[1]
        if now[:1] + now[2:] != before[:1] + before[2:] or was[:-1] != running:
            if rid in was and tuple(r for r in was if r != rid) == running:
                return self.refuse("preemption outside schedule()", f"{rid}: not the tail")
            return self.refuse("state edited between calls", "before _preempt_request()")
        if not was or was[-1] != rid:
            return self.refuse("preemption outside schedule()", f"{rid} was not running")
        if self.config.preemption == "priority":
            ranks = [(r.priority, self.ids.get(r.request_id, -1)) for r in sched.running]
            mine = (request.priority, self.ids.get(rid, -1))
            if any(rank > mine for rank in ranks):
                return self.refuse("preemption outside schedule()", f"{rid}: not the largest")
        if self.config.defer_free and self.in_flight:
            return self.refuse("preemption outside schedule()", f"{rid}'s free deferred")
        for feature in scheduler_features(sched) + pending_features(
            sched, scheduling=False, loaders=self.loads.waiting, held=self._grammars
        ):
            return self.refuse(*feature)
        step = self.next_step
        self.next_step += 1
        self._lone_at = step
        self.events.append(("begin", step))

    def _close_lone_preemption(self) -> None:
        step, self._lone_at = self._lone_at, None
        if step is not None:
            self.events.append(("submit", step))
            self.in_flight.append(InFlight(step, _EMPTY, {}))
        self._exit()

    def _prefill_lookahead(self, original: Method) -> Method:
        """Multi-module MTP's prefill lookahead shortens a prefill chunk so that it ends at
        the prompt's end or at least ``num_prefill_lookahead`` before it: a chunk size like
        any to the spec, which takes the ``schedule`` decision's tokens as given. Shortened
        to nothing, it makes vLLM pass over a waiting request and admit one behind it, which
        the spec's admission order does not allow: refused. (Where the KV-cache manager
        registers the last computed tokens late, ``num_reprefillable_tokens``, the scheduler
        is refused at every entry point.)"""

        def reserve(
            request: Request, num_computed_tokens: int, num_new_tokens: int, *args: Any, **kw: Any
        ) -> Any:
            tokens = original(request, num_computed_tokens, num_new_tokens, *args, **kw)
            waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if (
                waiting and num_new_tokens > 0 and not tokens
            ):  # shortened to nothing by the lookahead
                self.refuse("prefill lookahead (MTP)", f"{request.request_id} passed over")
            return tokens

        return reserve

    def _free_request(self, original: Method) -> Method:
        def free_request(request: Request, *args: Any, **kw: Any) -> Any:
            if self._grammars.pop(request.request_id, None) is not None:
                return original(request, *args, **kw)  # it never arrived to the spec
            if request.request_id in self._failing:  # its events: _failed_finished
                self.loads.forget(request.request_id)
                self._admitted.pop(request.request_id, None)
                self._appended.pop(request.request_id, None)
                return original(request, *args, **kw)
            if self.config.sliding_window is not None and self.scheduler.connector is not None:
                # vLLM's _connector_finished frees the blocks before the window first
                self.refuse(
                    "sliding window", f"{request.request_id} finishes beside a KV connector"
                )
            rid = self.ids.get(request.request_id)
            self.loads.forget(request.request_id)
            self._admitted.pop(request.request_id, None)
            self._appended.pop(request.request_id, None)
            aborted = request.request_id in self._aborting
            if aborted:
                self._aborting.discard(request.request_id)
                self.events.append(("abort", rid))
            result = original(request, *args, **kw)
            if request.request_id in self.scheduler.requests:
                self.refuse("delayed block free", f"{request.request_id} keeps its blocks")
            reason = "abort" if aborted else REASONS.get(request.status)
            if reason is None:
                self.refuse(f"finish {request.status}", "a finish the spec does not have")
                reason = str(request.status)
            if rid is not None:
                self._finishing[rid] = reason
            self.events.append(("finish", rid, reason))
            return result

        return free_request

    def _pop_blocks_for_free(self, original: Method) -> Method:
        def pop_blocks_for_free(request: Request, *args: Any, **kw: Any) -> Any:
            """``defer_block_free``: the request's table is given up, its references kept (the
            spec's ``Deferred`` holder, made by the ``finish``/``preempt``/``abort`` around it);
            the ``free`` events come when ``_drain_deferred_frees`` frees the blocks."""
            self._inner("pop_blocks_for_free")
            if not self.config.defer_free:
                self.refuse("deferred block free", "pop_blocks_for_free() without defer_free")
            return original(request, *args, **kw)

        return pop_blocks_for_free

    def _cache_blocks(self, original: Method) -> Method:
        def cache_blocks(request: Request, num_computed_tokens: int, *args: Any, **kw: Any) -> None:
            self._inner("cache_blocks")
            self._owner = request  # async scheduling, after the output; a landed load
            before = len(self.events)
            try:
                original(request, num_computed_tokens, *args, **kw)
            finally:
                self._owner = None
            if request.request_id in self.loads.waiting:
                # _update_waiting_for_remote_kv: the spec registers these when the request's
                # schedule decision comes (Config.delay_load_registration), so they wait for it
                self.loads.landing[request.request_id] = self.events[before:]
                del self.events[before:]

        return cache_blocks

    def _take_events(self, original: Method) -> Method:
        def take_events(*args: Any, **kw: Any) -> list[Any]:
            events = original(*args, **kw)
            self.native += events
            return events  # type: ignore[no-any-return]

        return take_events

    def _allocate_slots(self, original: Method) -> Method:
        def allocate_slots(request: Request, num_new_tokens: int, *args: Any, **kw: Any) -> Any:
            self._inner("allocate_slots")
            landed = request.request_id in self.loads.waiting  # running, to the spec
            waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            admission = waiting and not landed
            hits = kw.get("new_computed_blocks", args[1] if len(args) > 1 else None)
            slots = self._safe(self._slots_features, request, num_new_tokens, args, kw)
            loaded, extra = slots or (0, 0)
            if admission:
                self._safe(self._admission_room, request)
                if self._safe(read, self.scheduler, "aux_output_connector") is not None:
                    self._safe(self._bounded_hit, request, hits)
                for check in (skipped_read, lora_skips):
                    for feature in self._safe(check, self.scheduler, request) or ():
                        self.refuse(*feature)
                waiting_loads = self.loads.waiting
                for feature in (
                    self._safe(passed_over, self.scheduler, request, waiting_loads) or ()
                ):
                    self.refuse(*feature)
            rid = self.ids.get(request.request_id)
            self._current, self._current_request = rid, request
            self._pending, self._touched = [], []
            try:
                result = original(request, num_new_tokens, *args, **kw)
            finally:
                pending, self._current, self._current_request = self._pending, None, None
                self._pending = []
            if result is None:
                if pending and self._windowed and rid is not None:
                    # vLLM freed the blocks no step reads any more (a window's, a state
                    # group's), then found no room: the spec's trim, before the preemption
                    self.events.append(("trim", rid))
                    self.events.extend(pending)
                elif pending and self._windowed:
                    self.refuse("sliding window: skipped blocks freed by a failed allocation", "")
                    self.events.extend(pending)
                elif pending:
                    self.problems.append(f"allocate_slots failed after effects {pending}")
                return None
            self.events.append(("schedule", rid, num_new_tokens + extra, loaded))
            self._extra += extra
            if admission and self.hybrid:
                hit = hybrid_groups.hit_events(self, rid, hits)
            elif admission:
                blocks = hits.blocks[0] if hits is not None else []
                hit = tuple(b.block_id for b in blocks)
                self.events.append(("hit", rid, hit))
            if admission:
                if tuple(self._touched) != tuple(b for b in hit if b):  # a window's nulls
                    self.problems.append(f"r{rid} hit {hit} but vLLM touched {self._touched}")
                # every hash the lookup read, not only the hits: a hash that is not the
                # tokens' (LoRA, ...) may be what made it miss
                self._safe(self._check_hashes, request, len(request.block_hashes))
                if loaded and not num_new_tokens:
                    self.loads.start(request.request_id)
                self._admitted[request.request_id] = self._admissions
                if not (loaded and not num_new_tokens):  # else appended to running when landed
                    self._appended[request.request_id] = self._admissions
                self._admissions += 1
            if landed:
                self._appended[request.request_id] = self._admissions
                self._admissions += 1
            if landed:
                pending = self.loads.scheduled(request.request_id, pending)
            self.events.extend(pending)
            return result

        return allocate_slots

    def _slots_features(
        self, request: Request, num_new_tokens: int, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> tuple[int, int]:
        """Refuse what an ``allocate_slots`` call asks that the spec does not model; return the
        full blocks a KV load writes (0 without one: the ``schedule`` decision's last field)
        and the tokens past them a synchronous load writes into a block it does not fill. The
        spec's loads are of whole blocks; a synchronous one lands before the step's forward
        pass reads anything, so the tail of a partial block is to the spec computed in that
        step, as the tokens after it are (the decision's tokens count it; ``_submitted``
        refuses a step whose budget that would overrun). An asynchronous load not of whole
        blocks has no such reading: refused."""
        names = (
            "num_new_computed_tokens",
            "new_computed_blocks",
            "num_lookahead_tokens",
            "num_external_computed_tokens",
            "delay_cache_blocks",
            "num_encoder_tokens",
        )
        given = dict(zip(names, args, strict=False)) | kw
        for name, feature in (
            ("num_lookahead_tokens", "speculative decoding"),
            ("num_encoder_tokens", "encoder-decoder model"),
        ):
            if given.get(name):
                self.refuse(feature, f"allocate_slots({name}={given[name]})")
        external = int(given.get("num_external_computed_tokens") or 0)
        if self.config.sliding_window is not None and (external or given.get("delay_cache_blocks")):
            self.refuse("sliding window", f"{request.request_id}: a KV load under a window")
        if not external:
            return 0, 0
        bsz, local = self.block_size, int(given.get("num_new_computed_tokens") or 0)
        where = f"{request.request_id}: {external} external tokens after {local} cached"
        synchronous = num_new_tokens > 0
        if bool(given.get("delay_cache_blocks")) == synchronous:
            self.refuse("KV connector: a load's registration not vLLM's", where)
        elif local % bsz or (external % bsz and not synchronous):
            self.refuse("KV connector: a load not of whole blocks", where)
        elif (local + external) // bsz > loadable(request.num_tokens, bsz, not synchronous):
            # an asynchronous load may end there (vLLM and the spec recompute the last token
            # over the loaded block) unless a block holds that token alone
            self.refuse("KV connector: a load over the last token's block", where)
        return external // bsz, external % bsz

    def _admission_room(self, request: Request) -> None:
        """The spec counts a request loading asynchronously as running, vLLM as waiting: an
        admission the spec's ``max_running`` forbids only because of it is refused."""
        running = len(self.scheduler.running) + len(self.loads.waiting)
        if self.loads.waiting and running >= self.config.max_running:
            self.refuse(
                "KV connector: loading requests counted as running",
                f"{request.request_id} admitted beside {len(self.loads.waiting)} loading",
            )

    def _bounded_hit(self, request: Request, hits: Any) -> None:
        """An aux output connector's ``max_cache_hit`` bounds vLLM's lookup; the spec's hit is
        the longest cached prefix short of the last token's block (``spec.pool.lookup``). vLLM's
        own connector never bounds it lower (``features.scheduler_features``); a hit that stops
        before a block the pool holds, or covers the last token's block, is refused."""
        if not self.config.prefix_caching:
            return  # vLLM looks nothing up
        got = len(hits.blocks[0]) if hits is not None else 0
        most = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        where = f"{request.request_id}: {got} blocks hit"
        if got > most:
            self.refuse("aux output connector: a hit over the last token's block", where)
        elif got < min(most, len(hashes)) and self.pool.get_cached_block(hashes[got], [0]):
            self.refuse("aux output connector: a capped prefix-cache hit", f"{where}, more cached")

    def _get_new_blocks(self, original: Method) -> Method:
        def get_new_blocks(num_blocks: int, *args: Any, **kw: Any) -> list[Any]:
            self._inner("get_new_blocks")
            self._evicted = set()
            blocks = original(num_blocks, *args, **kw)
            for block in blocks:
                if block.block_id in self._evicted:
                    self._effect(("evict", block.block_id))
                self._effect(("alloc", self._current, block.block_id) + self._group_field())
            return blocks  # type: ignore[no-any-return]

        return get_new_blocks

    def _touch(self, original: Method) -> Method:
        def touch(blocks: Any, *args: Any, **kw: Any) -> None:
            self._inner("touch")
            self._touched += [b.block_id for b in blocks if not b.is_null]
            original(blocks, *args, **kw)

        return touch

    def _evict(self, original: Method) -> Method:
        def evict(block: Any, *args: Any, **kw: Any) -> bool:
            evicted = original(block, *args, **kw)
            if evicted:
                self._evicted.add(block.block_id)
            return evicted  # type: ignore[no-any-return]

        return evict

    def _insert(self, original: Method) -> Method:
        def insert(block_hash_with_group_id: Any, block: Any, *args: Any, **kw: Any) -> None:
            self._inner("_insert_block_hash")
            key = block_hash_with_group_id
            num_tokens = kw.get("num_tokens", args[0] if args else None)
            before = block.block_hash
            original(key, block, *args, **kw)
            if before is not None and before != key:
                self.refuse("partial prefix-cache hits", f"a second hash on block {block.block_id}")
            if before is None and block.block_hash is not None:
                group = hybrid_groups.group_of_key(key) if self.hybrid else 0
                index = (num_tokens or 0) // self.group_sizes[group] - 1
                owner = self._current_request if self._current is not None else self._owner
                rid = self.ids.get(owner.request_id) if owner is not None else None
                if owner is not None:
                    self._safe(self._check_hashes, owner, index + 1)
                self._effect(("publish", rid, index, block.block_id) + ((group,) if group else ()))

        return insert

    def _free_blocks(self, original: Method) -> Method:
        def free_blocks(ordered_blocks: Iterable[Any], *args: Any, **kw: Any) -> None:
            self._inner("free_blocks")
            blocks = list(ordered_blocks)
            self._safe(self._free_features, blocks)
            if self._safe(evict_first, args, kw):
                self.refuse(*EVICT_FIRST)
            freed = [("free", b.block_id) for b in blocks if not b.is_null]
            if self._current is not None and self._windowed:
                self._pending += freed  # blocks before the window: effects of the schedule
            else:
                self.events.extend(freed)
            original(blocks, *args, **kw)

        return free_blocks

    def _free_features(self, blocks: list[Any]) -> None:
        pool = self.pool.blocks
        if any(not 0 <= b.block_id < len(pool) or pool[b.block_id] is not b for b in blocks):
            self.refuse("blocks that are not the pool's", "free_blocks")
        unhashed = [b for b in blocks if not b.is_null and b.ref_cnt == 1 and b.block_hash is None]
        if len(unhashed) > 1 and self.config.prefix_caching and not self.config.spec_tokens:
            self.refuse(
                "a batch of unhashed blocks freed",
                "vLLM keeps their order at the queue's head, the spec reverses it",
            )

    def _group_field(self) -> tuple[int, ...]:
        """An event's trailing ``group`` field: none for one group (``docs/hybrid.md``)."""
        if not self.hybrid:
            return ()
        if self._group is None:
            self.refuse("hybrid KV-cache groups", "a block allocated outside a group's manager")
            return ()
        return (self._group,) if self._group else ()  # canonical: no field for group 0

    def _effect(self, event: Event) -> None:
        """Effects inside ``allocate_slots`` wait for its ``schedule`` decision."""
        if self._current is None:
            self.events.append(event)
        else:
            self._pending.append(event)

    def _lookahead(self, request: Request) -> None:
        """The request's block hasher's lookahead (``features.hasher_lookahead``) is the
        configuration's ``hash_lookahead``: taken as it at the first arrival, before any
        event (the plugin then rebuilds the judge); a request hashed otherwise, later or held
        beside it (priority arrivals), is refused ("lookahead hashing"). Prefix caching off
        reads no hash."""
        lookahead = hasher_lookahead(request) or 0
        first, self._hashed_arrival = not self._hashed_arrival, True
        if lookahead == self.config.hash_lookahead or not self.config.prefix_caching:
            return
        if not first or self.events or self.config.groups:
            self.refuse(
                "lookahead hashing",
                f"{request.request_id}'s hashes cover {lookahead} tokens after each block, "
                f"the configuration's {self.config.hash_lookahead}",
            )
            return
        self.config = replace(self.config, hash_lookahead=lookahead)

    def _check_hashes(self, request: Request, upto: int) -> None:
        """Block hashes must be a function of the token prefix (with ``hash_lookahead`` L, of the
        prefix and the L tokens after it), and a prefix's alone: a hash
        collision (two prefixes, one hash) or a hash that is not (one prefix, two hashes) is
        a hashing the spec's keys cannot follow."""
        hashes, tokens, bsz = request.block_hashes, request.all_token_ids, self.block_size
        start = self._checked.get(request.request_id, 0)
        for i in range(start, min(upto, len(hashes))):
            end = (i + 1) * bsz + self.config.hash_lookahead  # and the tokens after it
            link = (hashes[i - 1] if i else None, tuple(tokens[i * bsz : end]))
            known = self._links.setdefault(link, hashes[i])
            if known != hashes[i]:
                self.refuse("block hashes not a function of the tokens", f"{request.request_id}")
            if self._hashes.setdefault(hashes[i], link) != link:
                self.refuse("block hash collision", f"{request.request_id}'s block {i}")
        self._checked[request.request_id] = max(start, min(upto, len(hashes)))


@dataclass(frozen=True)
class _Empty:
    """The output of a step the attachment made for the caller's own preemption: no tokens."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


_EMPTY = _Empty()


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
        defer_loads=bool(read(scheduler, "defer_async_loads"))
        and bool(read(scheduler, "defer_block_free")),
        admission_window=versions.admission_window(scheduler),
        admission_threshold=versions.admission_threshold(scheduler),
        **hybrid_groups.spec_groups(scheduler),
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


__all__ = ["Attachment", "Event", "Feature", "Refusal", "STOP", "attach", "config_of"]
