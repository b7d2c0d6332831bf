"""The variables of the specification, their types and their initial values.

This module owns the *state* half of the spec (the ``VARIABLES`` of a TLA+ module): the parameters
of a configuration, one record per block, per request and per in-flight step, and ``initial_state``.
Actions live in ``actions.py``, registration policies in ``policies.py`` and invariants in
``invariants.py``. Everything here is plain standard-library Python so that a reader can check it
line by line; speed is the reference implementation's business, not the spec's.

A block's *hash* is modelled by what it names: the tuple of every token from position 0 to the end
of the block (``Key``). Two blocks share a key exactly when they hold the same chained prefix, so the
spec needs no hash function and has no collisions. Engines publish opaque hashes; the conformance
layer maps them onto keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

OBSERVED_POLICIES = ("engine-registers",)
"""Policies that only an observed judge can use (``judge``, observed matching). Under
``engine-registers`` the spec registers and rolls back nothing by itself: the engine's own
``publish`` and ``dedup`` effects are applied as they come (``spec/observed.py``), and the invariants
judge them. For engines whose registration points are none of ``policies.POLICIES`` (SGLang inserts into
its radix tree after a prefill chunk's result and at finish, and deduplicates on insert)."""
DISCIPLINES = ("vllm", "general")
PREEMPTIONS = ("fcfs", "priority")
STALE_OUTPUTS = ("drop", "deliver")
"""What becomes of the token a submitted step samples for a request preempted since (its *stale*
output): ``drop``, discarded, and the request may be re-admitted at once (vLLM's drop mode,
``requires_kv_delivery``); ``deliver``, appended to the request's tokens when that step commits,
and the request is not re-admitted until every step that held it has committed (vLLM's default,
``num_stale_output_tokens``)."""
NULL_BLOCK = 0
GROUP_KINDS = ("full", "window", "state", "cross", "slot", "chunked")
"""The kinds of KV-cache group the spec follows (``Group.kind``, ``docs/model.md``, "Hybrid
groups"): full attention, sliding-window attention, a recurrent state (Mamba, linear
attention) cached at block boundaries, cross-attention (an encoder-decoder model's K/V of
the request's encoder output, ``docs/model.md``, "Cross-attention"), ``slot``: a recurrent
state held in one private slot per request, rewritten in place by every step, cached and hit
by copying whole states (SGLang's MAMBA component; ``spec/slots.py``, ``docs/model.md``, "Slot
groups"), and chunked local attention (Llama 4's: a token attends to its own chunk of
``Group.chunk`` tokens only, ``docs/model.md``, "Chunked local attention")."""
REFUSED_GROUP_KINDS: dict[str, str] = {}
"""Group kinds an engine has that the spec refuses by name (``Config`` raises naming them)."""
STATE_REGISTRATIONS = ("at-its-step", "when-known")
"""When a state group registers the state at a block boundary (``Group.registers``;
``docs/model.md``, "Hybrid groups"): ``at-its-step``, only the step whose entry ends at the
boundary registers it (at its schedule, or at its commit when the boundary's tokens were not
all known at its schedule and no later schedule of the request has passed it); ``when-known``, vLLM's ``align`` ``MambaManager``: a state slot is
registered as a full block is, at the first registration point of the request (a schedule, a
commit) whose known tokens reach its boundary, if the slot holds a block (a slot no step ended
in holds the null block and registers nothing). The default (None) is ``at-its-step``."""

Key = tuple[int, ...]
"""A published hash, as the chained token prefix it names (tokens 0 .. end of the block)."""


class Placeholder(NamedTuple):
    """The token step ``step`` samples for request ``req``, before that step commits: a value no
    real token has. Under async scheduling a step may compute the K/V of a position whose token is
    not known yet (the input comes from the previous step's output on the device); the bytes it
    writes there hold this placeholder until the sampling step commits, which resolves it to the
    sampled token, or forever (garbage for every later reader) when that sample is discarded."""

    step: int
    req: int


class Draft(NamedTuple):
    """Speculative decoding: the guess a decode of step ``step`` feeds in for the ``slot``-th
    token that step samples for request ``req`` (a draft token, vLLM's ``spec_token_ids``), at
    the position just past the request's known tokens plus ``slot``. The step computes K/V from
    it; when the step commits, an accepted draft resolves to the token sampled there (the guess
    was right) and a rejected one never does: the bytes at its position are garbage for every
    reader that claims them, until a later step rewrites them."""

    step: int
    req: int
    slot: int


@dataclass(frozen=True, slots=True)
class Encoded:
    """What the encoder pass writes in cross-attention block ``position`` of request ``req``
    (``Config.groups``, kind ``cross``): the K/V of that request's encoder tokens
    ``position * B_g .. (position + 1) * B_g - 1``, a value no decoder token has (a dataclass,
    not a tuple: it equals no ``Placeholder`` or ``Draft`` of the same fields)."""

    req: int
    position: int


Content = tuple["int | Placeholder | Draft | Encoded", ...]
"""What a write puts in a block: a request's tokens 0 .. the last slot written, placeholders
and drafts included (a published ``Key`` never holds either)."""


class Group(NamedTuple):
    """One KV-cache group (vLLM's ``KVCacheGroupSpec``): every layer of the group shares one
    block table per request. ``block_size`` is a multiple of ``Config.block_size`` (the hash
    block size, the unit tokens are chained in); ``window`` is W for a ``window`` group and None
    otherwise; ``registers`` is a ``state`` group's registration rule (``STATE_REGISTRATIONS``;
    None: ``at-its-step``), None for the other kinds; ``chunk`` is C for a ``chunked`` group (a
    multiple of ``block_size``: token ``t`` attends to tokens ``(t // C) * C .. t``; vLLM's
    ``attention_chunk_size``) and None otherwise."""

    kind: str
    block_size: int
    window: int | None = None
    registers: str | None = None
    chunk: int | None = None

    def problem(self, hash_block: int) -> str:
        """Why this group is no group of a ``Config`` with hash block size ``hash_block``, or
        "" (the refusal of a kind the spec does not follow names it)."""
        if self.kind in REFUSED_GROUP_KINDS:
            return f"group kind {self.kind!r} is refused: {REFUSED_GROUP_KINDS[self.kind]}"
        if self.kind not in GROUP_KINDS:
            return f"unknown group kind {self.kind!r}; one of {', '.join(GROUP_KINDS)}"
        size = self.block_size
        if type(size) is not int or size < 1 or size % hash_block:
            return (
                f"a group's block_size must be a multiple of block_size {hash_block}, got {size!r}"
            )
        if self.kind == "window":
            if type(self.window) is not int or self.window < 1:
                return f"a window group needs an integer window >= 1, got {self.window!r}"
        elif self.window is not None:
            return f"only a window group has a window, got {self.window!r} for {self.kind!r}"
        if self.kind == "chunked":
            if type(self.chunk) is not int or self.chunk < 1 or self.chunk % size:
                return (
                    f"a chunked group's chunk must be a positive multiple of its block_size "
                    f"{size}, got {self.chunk!r}"
                )
        elif self.chunk is not None:
            return f"only a chunked group has a chunk, got {self.chunk!r} for {self.kind!r}"
        if self.registers is not None and self.kind != "state":
            return f"only a state group has a registration rule, got {self.registers!r}"
        if self.registers is not None and self.registers not in STATE_REGISTRATIONS:
            return (
                f"unknown state registration {self.registers!r}; "
                f"one of {', '.join(STATE_REGISTRATIONS)}"
            )
        return ""


class Illegal(Exception):
    """An event that is not an action of the spec in the current state: its guard is false."""


@dataclass(frozen=True, slots=True)
class Config:
    """The constants of a model (TLA+ ``CONSTANTS``)."""

    num_blocks: int
    """N, counting the null block 0: N - 1 blocks can hold K/V."""
    block_size: int
    """B, tokens per block."""
    depth: int = 1
    """D, how many submitted steps may be in flight: 1 sync, 2 async scheduling, k batch queue."""
    policy: str = "deferred"
    discipline: str = "vllm"
    preemption: str = "fcfs"
    token_budget: int = 64
    """Most tokens (prefill + decode) one step may schedule."""
    max_running: int = 8
    """Most requests running at once (vLLM ``max_num_seqs``)."""
    stop_token: int | None = None
    """A sampled token equal to this finishes its request (reason ``stop``)."""
    async_scheduling: bool = False
    """Schedule with placeholders: a request may be scheduled for the token an in-flight step
    samples for it before that step commits (vLLM's ``AsyncScheduler``, SGLang's overlap
    scheduler). False: a request waits for its sampled token to commit."""
    stale_output: str = "drop"
    """``STALE_OUTPUTS``: what becomes of a preempted request's output in a submitted step."""
    prefix_caching: bool = True
    """False: a pool without prefix caching (vLLM's ``enable_prefix_caching=False``): nothing is
    ever published, no lookup hits, and a table is freed as one batch (``pool.free_table``)."""
    spec_tokens: int = 0
    """K, speculative decoding: most draft tokens a running request's decode may be scheduled
    for beyond its known tokens (vLLM's ``num_speculative_tokens`` with a drafter that reserves
    no lookahead slots, n-gram); its commit says how many were accepted (``docs/model.md``,
    "Speculative decoding"). 0: none. With ``async_scheduling`` a decode in flight holds one
    placeholder per token it may sample (its drafts, then the bonus token), the next decode is
    scheduled as if every draft were accepted and moves back over the rejected ones when that
    step commits ("Drafts under async scheduling")."""
    delay_load_registration: bool = False
    """True: the blocks an asynchronous load writes are not registered at the load, but with the
    blocks its request computes when it is next scheduled, by which time the load has landed
    (vLLM's ``delay_cache_blocks`` and ``_update_waiting_for_remote_kv``). False: the policy
    registers them at the load like computed blocks (PR 43569's eager registration of loads)."""
    defer_free: bool = False
    """True: a request that leaves (finishes, aborts, is preempted, fails a load) while a
    submitted step still computes for it gives up its table at once, but its blocks stay
    referenced by a ``Deferred`` holder until the *fence* (the newest submitted step that
    computes tokens) commits; then they are freed as its table would have been (vLLM's
    ``defer_block_free``: ``deferred_frees``, drained at the top of ``update_from_output``).
    False: freed at once (``docs/model.md``, "Deferred block free")."""
    sliding_window: int | None = None
    """W: one KV-cache group of sliding-window attention (vLLM's ``SlidingWindowManager``):
    token t attends to positions t - W + 1 .. t only. A hit needs the ceil((W - 1) / B) blocks
    just before its end (the table holds the null block before them); when a running request
    is scheduled, the blocks wholly before the window of its next processed token are freed
    and replaced by the null block (``pool.remove_skipped``); a step reads only its window.
    None: full attention (``docs/model.md``, "Sliding window")."""
    groups: tuple[Group, ...] = ()
    """The KV-cache groups, in the engine's order (vLLM's ``kv_cache_groups``); group 0 is the
    first. Empty: one group, full attention or, with ``sliding_window``, a window (every trace
    before groups reads so). Tables, published keys and effects are per group (``docs/model.md``,
    "Hybrid groups"); block ids are global (one shared pool)."""
    defer_loads: bool = False
    """With ``defer_free``: an asynchronous load admitted while a submitted step that computes
    is in flight starts only once the steps in flight then have committed, and until then its
    request's blocks are fenced like those of a request a submitted step computes for: given
    up, they wait for the newest submitted step that computes (vLLM's ``defer_async_loads``,
    ``deferred_loads``; ``docs/model.md``, "Deferred block free")."""
    hash_lookahead: int = 0
    """L, lookahead hashing: the key of a block names its tokens and the L tokens after it (vLLM's
    block hasher with ``num_hash_lookahead_tokens``: a drafter's K/V at a block's last position
    depends on them), so a block has a key, and can be published or hit, only once those L
    tokens are known (``State.hashed``). 0: a key names the block's prefix alone
    (``docs/model.md``, "Lookahead hashing")."""
    admission_window: int = 0
    """Cache-aware admission (vLLM 0.34.0's ``cache_aware_admission_window``, fcfs with prefix
    caching): the first this many waiting requests are reordered, deepest cached prefix first,
    once per step that preempts nothing, when the pool's usage is at least
    ``admission_threshold`` (``spec/admission.py``; ``docs/model.md``, "Cache-aware
    admission"). 0: strict queue order."""
    admission_threshold: float = 0.5
    """The usage (1 - free / (N - 1)) below which ``admission_window`` is not applied."""
    trim_at_finish: bool = False
    """``WindowFinish``, with ``sliding_window``: a request that finishes or is aborted first
    frees its blocks wholly before the window of the token after its *processed* ones (as a
    schedule would, ``pool.remove_skipped``; the tokens of the committing step count as
    processed), then gives up the rest of its table (vLLM's ``_connector_finished`` beside a
    KV connector, before ``request_finished`` is handed the table; ``docs/model.md``, "Sliding
    window"). False: the table is given up in one piece, the skipped blocks with it."""

    def __post_init__(self) -> None:
        from .policies import POLICIES  # the registry: policies.py imports this module

        checks = [
            (
                self.num_blocks >= 2,
                f"num_blocks must be >= 2 (block 0 is null), got {self.num_blocks}",
            ),
            (self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"),
            (self.depth >= 1, f"depth must be >= 1, got {self.depth}"),
            (
                self.policy in POLICIES or self.policy in OBSERVED_POLICIES,
                f"unknown policy {self.policy!r}; one of {', '.join((*POLICIES, *OBSERVED_POLICIES))}",
            ),
            (self.discipline in DISCIPLINES, f"unknown discipline {self.discipline!r}"),
            (
                self.admission_window >= 0 and 0.0 <= self.admission_threshold <= 1.0,
                "admission_window must be >= 0 and admission_threshold in [0, 1]",
            ),
            (self.preemption in PREEMPTIONS, f"unknown preemption {self.preemption!r}"),
            (self.token_budget >= 1, f"token_budget must be >= 1, got {self.token_budget}"),
            (self.max_running >= 1, f"max_running must be >= 1, got {self.max_running}"),
            (
                self.stale_output in STALE_OUTPUTS,
                f"unknown stale_output {self.stale_output!r}; one of {', '.join(STALE_OUTPUTS)}",
            ),
            (
                isinstance(self.prefix_caching, bool),
                f"prefix_caching must be a bool, got {self.prefix_caching!r}",
            ),
            (
                isinstance(self.spec_tokens, int) and self.spec_tokens >= 0,
                f"spec_tokens must be an integer >= 0, got {self.spec_tokens!r}",
            ),
            (
                isinstance(self.delay_load_registration, bool),
                f"delay_load_registration must be a bool, got {self.delay_load_registration!r}",
            ),
            (
                isinstance(self.defer_free, bool),
                f"defer_free must be a bool, got {self.defer_free!r}",
            ),
            (
                self.sliding_window is None
                or (isinstance(self.sliding_window, int) and self.sliding_window >= 1),
                f"sliding_window must be None or an integer >= 1, got {self.sliding_window!r}",
            ),
            (
                isinstance(self.groups, tuple) and all(isinstance(g, Group) for g in self.groups),
                f"groups must be a tuple of Group, got {self.groups!r}",
            ),
            (
                not (self.groups and self.sliding_window is not None),
                "groups and sliding_window together: a window is a group of groups",
            ),
            (
                isinstance(self.defer_loads, bool) and (self.defer_free or not self.defer_loads),
                f"defer_loads must be a bool, and needs defer_free, got {self.defer_loads!r}",
            ),
            (
                isinstance(self.hash_lookahead, int)
                and self.hash_lookahead >= 0
                and not (self.hash_lookahead and self.groups),
                f"hash_lookahead must be an integer >= 0, one group only, got {self.hash_lookahead!r}",
            ),
            (
                isinstance(self.trim_at_finish, bool)
                and (self.sliding_window is not None or not self.trim_at_finish),
                f"trim_at_finish must be a bool, and needs sliding_window, got {self.trim_at_finish!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for g, group in enumerate(self.groups):
            problem = group.problem(self.block_size)
            if problem:
                raise ValueError(f"group {g}: {problem}")
        slot_problem = _slot_problem(self)
        if slot_problem:
            raise ValueError(slot_problem)
        if len(self.groups) > 1:
            first = self.groups[0]
            limits = [
                (
                    first.kind not in ("state", "chunked") and first.block_size == self.block_size,
                    "group 0 of several must be full or window, at block_size (not modelled)",
                ),
                (not self.spec_tokens, "several groups with spec_tokens are not modelled"),
                (not self.defer_free, "several groups with defer_free are not modelled"),
            ]
            for ok, message in limits:
                if not ok:
                    raise ValueError(message)

    @property
    def slots(self) -> bool:
        """A group of kind ``slot`` is among the groups (``spec/slots.py``)."""
        return any(group.kind == "slot" for group in self.groups)

    @property
    def window(self) -> int | None:
        """Group 0's sliding window W, or None (``sliding_window``, or the first group's)."""
        return self.groups[0].window if self.groups else self.sliding_window

    @property
    def chunk(self) -> int | None:
        """Group 0's attention chunk C (a ``chunked`` group 0, alone), or None."""
        return self.groups[0].chunk if self.groups else None

    @property
    def local(self) -> bool:
        """Group 0 is local attention, a sliding window or chunked: the positions before the
        reach of a request's next token are freed and hold the null block (``State.skipped``)."""
        return self.window is not None or self.chunk is not None

    @property
    def hybrid(self) -> bool:
        """Several groups: the tables, lookups and effects of groups 1.. are followed too."""
        return len(self.groups) > 1


def _slot_problem(config: Config) -> str:
    """Why ``config``'s slot groups are none it can have, or "": a slot group is never group 0
    (the table ``actions.py`` handles is a block per position), and with prefix caching it is
    cached only by the engine's own ``snapshot`` effects, so only under ``engine-registers``:
    none of the spec's own policies snapshots (``docs/model.md``, "Slot groups")."""
    if not config.slots:
        return ""
    if config.groups[0].kind == "slot":
        return "group 0 of kind 'slot' is not modelled: a slot group follows a full group 0"
    if config.prefix_caching and config.policy != "engine-registers":
        return (
            f"a slot group under policy {config.policy!r}: a slot group is cached only by the "
            "engine's own snapshots (engine-registers)"
        )
    return ""


@dataclass(slots=True)
class Write:
    """A write scheduled on a block: step ``step`` will write request ``req``'s K/V there, after
    which the block holds ``prefix`` (tokens 0 .. the last slot written)."""

    step: int
    req: int
    prefix: Content
    load: bool = False
    """Written by an external KV load (a connector) rather than by the model; it may fail."""
    source: int | None = None
    """A slot group's copy (``spec/slots.py``): the block takes a copy of block ``source``'s
    bytes when step ``step`` executes, before any read or write of that step, in the order the
    copies were made (``State.copies``); ``prefix`` is what the copy was foreseen to bring when it
    was made (what ``source`` will hold then, as far as the writes in flight tell)."""
    track: bool = False
    """A slot group's track write (``spec/tracks.py``): the step's recurrence also leaves its state
    after ``len(prefix)`` tokens in this track slot, when the step executes, after its reads."""


@dataclass(slots=True)
class Block:
    refcount: int = 0
    key: Key | None = None
    """The published hash (visible to lookups), or None."""
    written: Content | None = None
    """Content: the prefix the block's bytes hold, or None for garbage (never written, or
    computed from wrong inputs). Freeing or reusing a block does not change its bytes."""
    pending: list[Write] = field(default_factory=list)
    """Writes of in-flight steps, oldest step first."""
    group: int = 0
    """The KV-cache group whose table last took the block (its published key is that group's)."""


@dataclass(slots=True)
class Request:
    id: int
    tokens: list[int]
    """Prompt then sampled tokens; grows at commit."""
    prompt_len: int
    max_tokens: int
    priority: int
    arrival: int
    status: str = "waiting"
    """waiting | running | finished"""
    table: list[int] = field(default_factory=list)
    """Block table: table[i] holds tokens i*B .. (i+1)*B - 1."""
    computed: int = 0
    """Tokens whose K/V is written or scheduled to be written (vLLM ``num_computed_tokens``)."""
    cached: int = 0
    """Leading table blocks already registered (vLLM ``num_cached_block``)."""
    loading: int | None = None
    """The step of an external KV load not yet confirmed; the request waits for it."""
    loaded_last: bool = False
    """An asynchronous load wrote the block of the last known token whole (vLLM's whole-prompt
    load, ``actions.loadable``): ``computed`` stops one short only so that the next step
    recomputes that token over the loaded block, whose K/V is all there. Cleared when the request
    is scheduled again or lets go of its table. ``SharedImpliesSamePrefix`` counts that block as
    full."""

    preempted: bool = False
    """Preempted since it last ran and not admitted again (vLLM's ``PREEMPTED`` status): the
    cache-aware reorder does not move it (``spec/admission.py``). Kept only with
    ``Config.admission_window``, its one reader."""
    group_tables: list[list[int]] = field(default_factory=list)
    """Several groups (``Config.groups``): the tables of groups 1 .. G - 1, in group order
    (``table`` is group 0's); ``group_tables[g - 1][i]`` holds that group's block ``i``, tokens
    ``i * B_g .. (i + 1) * B_g - 1``. Empty for one group."""
    group_cached: list[int] = field(default_factory=list)
    """``cached`` of groups 1 .. G - 1, in group order."""
    encoder: int = 0
    """The request's encoder tokens (``arrive``'s ``encoder``): a ``cross`` group's table holds
    ``ceil(encoder / B_g)`` blocks while it runs (``docs/model.md``, "Cross-attention")."""
    slots: dict[int, int] = field(default_factory=dict)
    """Slot groups (``spec/slots.py``): the slot block of each slot group the request holds, or
    last held (kept after it lets go of its tables: a finished request's ``snapshot`` names
    the state it left there)."""
    tracks: dict[int, list[int]] = field(default_factory=dict)
    """Slot groups' track slots (``spec/tracks.py``) the request holds, or held when it let go of
    its tables (a finished request donates one: SGLang's ``_select_finished_checkpoint``)."""

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(slots=True)
class Entry:
    """One request's part in a step: compute (or load) tokens ``start .. end - 1``."""

    start: int
    end: int
    blocks: tuple[int, ...]
    """The table prefix the step reads and writes: blocks 0 .. ceil(end / B) - 1."""
    load: bool = False
    """An asynchronous external load: the step writes the loaded blocks and computes nothing
    for the request, which waits (``Request.loading``) until the step commits; it may fail."""
    samples: bool = False
    """The step reaches the end of the request's tokens (known ones and placeholders), so it
    samples the next token."""
    drafts: int = 0
    """Draft tokens scheduled past the request's known tokens (``Draft`` slots 0 .. drafts - 1,
    the entry's last ``drafts`` positions); the commit samples 1 .. drafts + 1 tokens."""
    loaded: int = 0
    """Full blocks an external load writes, from ``start`` on. With ``load`` False and tokens
    computed after them the load is *synchronous* (vLLM's connector with ``load_kv_async``
    False): the worker lands it before the step's forward pass, which reads it; it cannot fail
    (vLLM recomputes a failed synchronous load from its first invalid block, which the spec does
    not model). The step's budget is ``end - start - loaded * B``, the tokens it computes."""
    group_blocks: tuple[tuple[int, ...], ...] = ()
    """Several groups: the table prefix of each group 1 .. G - 1 the step reads and writes (a
    state group's: its blocks at the entry's start and end boundaries)."""


@dataclass(slots=True)
class Step:
    id: int
    phase: str = "building"
    """building (being scheduled) | submitted | executed. Committed steps leave the state."""
    entries: dict[int, Entry] = field(default_factory=dict)
    """The step's output, in scheduling order. Preempting or aborting a request while the step
    is building removes its entry; once submitted, the worker holds the batch and writes it all."""
    live: set[int] = field(default_factory=set)
    """Requests whose results will be used at commit: their reads matter and their sampled token
    is appended (not aborted, finished or, with stale output dropped, preempted since)."""
    registrations: dict[int, list[int]] = field(default_factory=dict)
    """Eager registrations made while scheduling this step, as block indices per request: the
    bucket of ``eager-rollback-fifo`` and the hidden entries of ``hide-uncommitted``."""
    group_registrations: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """``registrations`` of groups 1 .. G - 1, as (group, index) per request."""
    failed: tuple[int, ...] = ()
    """Requests whose external load failed when the step executed."""
    budget_used: int = 0
    preempted: bool = False
    victims: list[int] = field(default_factory=list)
    """The requests this step preempted, in order: those whose output in flight a reset in this
    step discards (``actions.reset``)."""
    admitted: bool = False
    reordered: bool = False
    """The cache-aware admission rule was applied in this step (``spec/admission.py``)."""


@dataclass(frozen=True, slots=True)
class Deferred:
    """``Config.defer_free``: the blocks request ``req`` gave up while a submitted step still
    computed for it, in table order. They keep the references the table held (a holder of its
    own, counted by ``RefcountIsOwnership``) until step ``fence`` commits, then are freed as the
    table would have been, last block first (vLLM's ``deferred_frees`` entry)."""

    fence: int
    req: int
    blocks: tuple[int, ...]


@dataclass(slots=True)
class Touched:
    """What the last decision touched (and, in observed judging, the engine's own effects after
    it): written by the actions and the pool as they change the state, read by the incremental
    invariant checks, which re-evaluate only what is named here. Not part of the model's meaning:
    a record, like a TLA+ trace's annotation of each step."""

    blocks: set[int] = field(default_factory=set)
    """Refcount, hash, free-queue place or holders changed."""
    content: set[int] = field(default_factory=set)
    """``written`` or ``pending`` changed, or a failed load on the block stopped being excused."""
    requests: set[int] = field(default_factory=set)
    """Table, computed tokens, status or tokens changed."""
    entries: set[tuple[int, int]] = field(default_factory=set)
    """(step, request) entries created: all their reads are new."""
    left: set[int] = field(default_factory=set)
    """Requests that stopped running (preempted, failed load, finished, aborted)."""
    swapped: list[tuple[int, int, int]] = field(default_factory=list)
    """(request, table index, block): a running table changed in place by an engine's own
    ``dedup`` (sanctioned: TablesAppendOnly judges only the rest of the change)."""
    steps: bool = False
    """A step began, was submitted, executed or committed."""

    def merge(self, other: Touched) -> None:
        self.blocks |= other.blocks
        self.content |= other.content
        self.requests |= other.requests
        self.entries |= other.entries
        self.left |= other.left
        self.swapped += other.swapped
        self.steps |= other.steps


@dataclass(slots=True)
class State:
    config: Config
    blocks: list[Block]
    free: list[int]
    """The free queue, head (next to allocate) first."""
    index: dict[Key, list[int]]
    """Published keys to blocks, oldest registration first; a lookup takes the first (group 0's,
    the only one of a one-group model)."""
    requests: dict[int, Request] = field(default_factory=dict)
    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    """In-flight steps, oldest first; a building step, if any, is last."""
    next_step: int = 0
    single: dict[int, list[int]] = field(default_factory=dict)
    """The one registration dict of ``eager-rollback-single`` (cleared at each begin)."""
    group_single: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """``single`` of groups 1 .. G - 1, as (group, index) per request."""
    deferred: list[Deferred] = field(default_factory=list)
    """``Config.defer_free``: blocks given up while a step still computes for their request,
    oldest first; each is freed at the commit of its fence step (in this order)."""
    bad_reads: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, request, block) for every live read that found the wrong bytes at execution."""
    bad_state_reads: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, request, block) for every live read of a state block (``Config.groups``) that did
    not find the state after exactly the step's start at execution."""
    steered_allocs: list[int | None] = field(default_factory=list)
    """Observed judging: one entry per block the engine allocated in the decision being applied,
    in its order (``observed.steer``), each taken by the next allocation (``pool.take_free``):
    None where the block was free before the decision (``steer`` moved it to the free queue's
    head, which the allocation takes), the block itself where the decision frees it first (a
    window's or a state group's skipped block), checked free at that moment."""
    steered_hits: list[list[int]] | None = None
    """Observed judging of several groups: the engine's hit of each group for the admission
    the next decision makes (``observed.steer``), taken by ``actions.schedule`` in place of
    its own lookup."""
    admission: tuple[int, int, tuple[tuple[int, ...], ...]] | None = None
    """Several groups: (request, hit length, every group's hit blocks) of an admission by the
    last decision, judged by ``HitServedByEveryGroup``; None otherwise."""
    lost_hits: int = 0
    """Valid, unreferenced cache entries dropped by a rollback (safe but wasted)."""
    commits: int = 0
    arrivals: int = 0
    """Requests that ever arrived: the next one's arrival order (``Request.arrival``)."""
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    """Slot groups: (step, source, target) of every copy not run yet, in the order they were
    made; step ``step``'s execute runs its copies first (``spec/slots.py``)."""
    group_index: dict[int, dict[Key, list[int]]] = field(default_factory=dict)
    """Several groups: the published index of each group 1 .. G - 1 (vLLM keys it by
    ``(hash, group)``); ``index_of`` reads any group's."""
    touched: Touched = field(default_factory=Touched, compare=False)
    """What the last decision touched (``Touched``); ``actions.apply`` starts a new record."""

    @property
    def building(self) -> Step | None:
        if self.steps and self.steps[-1].phase == "building":
            return self.steps[-1]
        return None

    def index_of(self, group: int) -> dict[Key, list[int]]:
        """Group ``group``'s published index: keys to blocks, oldest registration first."""
        return self.index if group == 0 else self.group_index.setdefault(group, {})

    def table_of(self, req: Request, group: int) -> list[int]:
        """Request ``req``'s table of group ``group``."""
        return req.table if group == 0 else req.group_tables[group - 1]

    def first_read(self, start: int) -> int:
        """The first table index a computation of tokens from ``start`` on reads as computed
        prefix: 0 under full attention; with a sliding window W, the block of position
        ``start - W + 1`` (the window of token ``start``); with a chunked group 0 of chunk C,
        the block of the start of token ``start``'s chunk, ``(start // C) * C``."""
        return self.skipped(start)

    def skipped(self, computed: int) -> int:
        """With a sliding window W, the leading table blocks wholly before the window of the
        token after ``computed`` tokens: ``(computed - W + 1) // B`` (vLLM's
        ``get_num_skipped_tokens`` in blocks); with a chunked group 0 of chunk C, those of the
        whole chunks before that token's: ``(computed // C) * C // B``
        (``ChunkedLocalAttentionManager.get_num_skipped_tokens``); 0 under full attention."""
        w, c = self.config.window, self.config.chunk
        if c is not None:
            return computed // c * c // self.config.block_size
        return 0 if w is None else max(0, computed - w + 1) // self.config.block_size

    def key(self, req: Request, index: int) -> Key:
        """The chained hash of the request's block ``index`` (of its known tokens): its prefix,
        and with ``hash_lookahead`` L the L tokens after it (a block below ``hashed`` has them)."""
        return tuple(
            req.tokens[: (index + 1) * self.config.block_size + self.config.hash_lookahead]
        )

    def hashed(self, req: Request) -> int:
        """How many of the request's leading blocks have a key: its full blocks, less those
        whose ``hash_lookahead`` tokens after them are not known yet."""
        return max(0, len(req.tokens) - self.config.hash_lookahead) // self.config.block_size

    def seen(self, req: Request, step: int, entry: Entry) -> list[int | Placeholder | Draft]:
        """The request's tokens 0 .. ``entry.end`` - 1 as ``entry`` of step ``step`` computes
        them: ``ahead``, then the entry's draft tokens."""
        drafts = [Draft(step, req.id, j) for j in range(entry.drafts)]
        return self.ahead(req)[: entry.end - entry.drafts] + drafts

    def ahead(self, req: Request) -> list[int | Placeholder | Draft]:
        """The request's tokens as its steps in flight see them: the known ones, then for each
        step in flight that samples for it and whose sample will be used, oldest first, the
        tokens it may sample as if every draft were accepted: its drafts (``Draft``), then its
        own token (``Placeholder``; vLLM's ``num_output_placeholders`` counts these). Without
        async scheduling no step is built while one samples for the request, so this is its
        known tokens up to the length of its tokens."""
        out: list[int | Placeholder | Draft] = list(req.tokens)
        for st in self.steps:
            e = st.entries.get(req.id)
            if e is not None and e.samples and req.id in st.live:
                out += [Draft(st.id, req.id, j) for j in range(e.drafts)]
                out.append(Placeholder(st.id, req.id))
        return out


def initial_state(config: Config) -> State:
    """All blocks free in id order, nothing published, no requests, no steps."""
    blocks = [Block() for _ in range(config.num_blocks)]
    return State(config=config, blocks=blocks, free=list(range(1, config.num_blocks)), index={})
