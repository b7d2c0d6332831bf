"""Engine configuration: the constants of one engine instance, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


class PolicyTraits(NamedTuple):
    """A registration policy as the engine follows it (``policies.TraitPolicy``): when a block
    is published (``at-schedule``, ``hidden-until-written``, ``at-written``), what is tracked
    for a rollback (``nothing``, ``one-dict``, ``per-step``), what a leaving request undoes
    (``nothing``, ``unpublish``, ``drop-hidden``) and when the tracking is forgotten
    (``never``, ``on-begin``, ``on-confirmed``, ``on-written``). The engine's own vocabulary:
    the spec's ``Traits`` use the same words, which a test checks (the engine imports no spec)."""

    publish: str
    track: str
    leave: str
    clear: str


POLICIES: dict[str, PolicyTraits] = {
    "eager-unsafe": PolicyTraits("at-schedule", "nothing", "nothing", "never"),
    "eager-rollback-single": PolicyTraits("at-schedule", "one-dict", "unpublish", "on-begin"),
    "eager-rollback-fifo": PolicyTraits("at-schedule", "per-step", "unpublish", "on-confirmed"),
    "hide-uncommitted": PolicyTraits(
        "hidden-until-written", "per-step", "drop-hidden", "on-written"
    ),
    "deferred": PolicyTraits("at-written", "nothing", "nothing", "never"),
}
"""The policies the engine knows by name. Another combination of the same traits is run by
naming it with ``EngineConfig.policy_traits`` (the conformance layer hands over the spec's)."""
OWN_POLICIES: dict[str, PolicyTraits] = {
    "engine-registers": PolicyTraits("by-engine", "nothing", "nothing", "never"),
}
"""The policies under which the engine registers on its own (``own_registration.py``): its
publishes, snapshots and evictions are its own effects, judged by the spec's observed judge
(the spec's ``OBSERVED_POLICIES``, whose record is ``BY_ENGINE``)."""
GROUP_KINDS = ("full", "window", "state", "cross", "slot", "chunked")
"""The KV-cache group kinds the engine follows (docs/hybrid.md): full attention, sliding-window
attention, a recurrent (Mamba / linear-attention) state in vLLM's ``align`` mode, an
encoder-decoder model's cross-attention (a table of the request's encoder tokens,
``Engine.add_request``'s ``encoder``; never group 0), a recurrent state in one slot per request
(SGLang's MAMBA ``no_buffer``, ``slots.py``), and chunked local attention (a token attends to its
own chunk of ``GroupSpec.chunk`` tokens only)."""


class GroupSpec(NamedTuple):
    """One KV-cache group as the engine follows it: its kind (``GROUP_KINDS``), its block size
    (a multiple of ``EngineConfig.block_size``, the hash block size) and, for a ``window``
    group, its window in tokens; for a ``state`` group, ``registers``, when its states are
    registered (``STATE_REGISTRATIONS``; None: ``at-its-step``); for a ``chunked`` group,
    ``chunk``, its attention chunk in tokens (a multiple of its block size). The engine's own
    representation of the spec's ``Group``, which a test checks field by field (the engine
    imports no spec)."""

    kind: str
    block_size: int
    window: int | None = None
    registers: str | None = None
    chunk: int | None = None


STATE_REGISTRATIONS = ("at-its-step", "when-known")
"""When a state group registers the state at a block boundary (``groups.GroupedKV``):
``at-its-step``, only in the step that ends there; ``when-known``, vLLM's ``align``
``MambaManager``: a slot is registered as a full block is, once the known tokens reach its
boundary (its block, unless the slot is null)."""


SLOT_BUFFERS = ("no_buffer", "extra_buffer")
"""How a slot group's states are cached under the engine's own registration (SGLang's MAMBA
strategies, ``own_registration.py``): ``no_buffer``, by copy of the working slot;
``extra_buffer``, through two track slots per request, written beside the working slot and
donated to the cache (``slots.py``, ``own_registration.py``)."""


DISCIPLINES = ("vllm", "general")
PREEMPTIONS = ("fcfs", "priority")
STALE_OUTPUTS = ("drop", "deliver")
"""What becomes of the token a submitted step samples for a request preempted since: ``drop``
(discarded; the request may be admitted again at once) or ``deliver`` (appended when that step
commits; the request is not admitted again until every step holding it has committed)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Pool geometry, scheduling limits, registration policy and the fake model's vocabulary."""

    num_blocks: int
    """Blocks in the pool, counting the null block 0."""
    block_size: int
    """Tokens per block."""
    depth: int = 1
    """Submitted steps that may be in flight at once (1 sync, 2 async scheduling, ...)."""
    policy: str = "deferred"
    discipline: str = "vllm"
    preemption: str = "fcfs"
    token_budget: int = 64
    max_running: int = 8
    stop_token: int | None = None
    vocab: int = 8
    """The fake model samples tokens in [0, vocab)."""
    prefix_caching: bool = True
    """False: a pool without prefix caching (vLLM's ``enable_prefix_caching=False``, the
    spec's ``Config.prefix_caching``): lookups find nothing, no policy publishes anything, and a
    table is freed as one batch at the free queue's head (``BlockPool.free_batch``)."""
    async_scheduling: bool = False
    """Schedule a running request on the tokens its in-flight steps will sample (placeholders,
    vLLM's ``num_output_placeholders``): one more position per such step. False: a request
    waits for its sampled token to commit before it is scheduled again."""
    stale_output: str = "drop"
    """``STALE_OUTPUTS``: what becomes of a preempted request's output in a submitted step."""
    spec_tokens: int = 0
    """K, speculative decoding (the spec's ``Config.spec_tokens``): after each sample a running
    request's drafter proposes up to K draft tokens (``choices.py``, ``drafts``), its next decode
    is scheduled for them too (within the budget), and the worker accepts some (``rejected``);
    the rejected ones leave the computed tokens. With ``async_scheduling`` the drafter proposes
    them when a sampling decode is scheduled (vLLM's ``AsyncScheduler``), the next decode is
    scheduled as if all were accepted and moves back over the rejected ones at the commit."""
    sync_loads: bool = False
    """External loads are synchronous: an external request loads its stored blocks and computes
    the rest of its prompt in the same step (vLLM's connector with ``load_kv_async`` False); such
    a load never fails. False: it loads and computes nothing until the load's step commits."""
    load_last_block: bool = False
    """An asynchronous load may take the block of the last known token too, when it is full and
    holds more than that token (vLLM's whole-prompt load, the decode side of prefill/decode
    disaggregation): the request then recomputes that token over the loaded block. False: a
    load stops before that block (the spec allows both)."""
    delay_load_registration: bool = False
    """The spec's ``Config.delay_load_registration``: an asynchronous load's blocks are
    registered when its request is next scheduled, not at the load (vLLM's
    ``delay_cache_blocks``)."""
    defer_free: bool = False
    """vLLM's ``defer_block_free`` (the spec's ``Config.defer_free``): a request that leaves
    while a submitted step still computes for it gives up its table at once, and its blocks
    go back to the pool only when the newest step that computed anything by then has been
    committed (``Scheduler``: step sequence numbers and a queue of fenced frees)."""
    sliding_window: int | None = None
    """W, one KV-cache group of sliding-window attention (the spec's ``Config.sliding_window``,
    vLLM's ``SlidingWindowManager``): hits need the ``ceil((W - 1) / B)`` blocks before their
    end and hold the null block before them; a running request's blocks wholly before the
    window of its next processed token are freed and nulled when it is scheduled. None: full
    attention."""
    policy_traits: tuple[str, str, str, str] | None = None
    """The policy's traits (``PolicyTraits``), for a policy not in ``POLICIES``; None: the
    traits ``POLICIES`` gives its name."""
    groups: tuple[GroupSpec, ...] = ()
    """Several KV-cache groups over the one pool (the spec's ``Config.groups``, vLLM's
    ``HybridKVCacheCoordinator``; ``groups.py``): empty, one group as ``sliding_window`` says.
    ``block_size`` is then the hash block size, the unit tokens are chained and registered in.
    External loads are not modelled with groups (no request loads), nor speculative decoding."""
    slot_buffer: str = "no_buffer"
    """``SLOT_BUFFERS``: how a slot group's states are cached under ``engine-registers`` (an
    engine choice the spec's ``Config`` does not name: both are judged by the same effects)."""
    defer_loads: bool = False
    """vLLM's ``defer_async_loads`` (the spec's ``Config.defer_loads``; needs ``defer_free``):
    an asynchronous load admitted while a counted step is in flight starts only once that step
    has been committed, so until then its request counts as computed for by it."""

    @property
    def cross(self) -> bool:
        """A cross-attention group is among the groups: requests may carry encoder tokens."""
        return any(g.kind == "cross" for g in self.groups)

    @property
    def traits(self) -> PolicyTraits:
        """The policy's traits: ``policy_traits`` when given, else its name's in ``POLICIES``."""
        if self.policy_traits is not None:
            return PolicyTraits(*self.policy_traits)
        return POLICIES[self.policy] if self.policy in POLICIES else OWN_POLICIES[self.policy]

    @property
    def reach(self) -> int:
        """How many positions past its prompt and ``max_tokens`` a request's table may reach:
        its drafts (K) and, under async scheduling, the tokens and drafts of the other D - 1
        steps in flight, scheduled as if every draft were accepted ((D - 1)(K + 1))."""
        if self.spec_tokens and self.async_scheduling:
            return self.spec_tokens + (self.depth - 1) * (self.spec_tokens + 1)
        return self.spec_tokens

    def __post_init__(self) -> None:
        checks = (
            (_is_int(self.num_blocks) and self.num_blocks >= 2, "num_blocks must be an int >= 2"),
            (_is_int(self.block_size) and self.block_size >= 1, "block_size must be an int >= 1"),
            (_is_int(self.depth) and self.depth >= 1, "depth must be an int >= 1"),
            (
                self.policy in POLICIES
                or self.policy in OWN_POLICIES
                or self.policy_traits is not None,
                f"policy must be one of {', '.join((*POLICIES, *OWN_POLICIES))}, or come with "
                "its policy_traits",
            ),
            (self.discipline in DISCIPLINES, f"discipline must be one of {', '.join(DISCIPLINES)}"),
            (self.preemption in PREEMPTIONS, f"preemption must be one of {', '.join(PREEMPTIONS)}"),
            (
                _is_int(self.token_budget) and self.token_budget >= 1,
                "token_budget must be an int >= 1",
            ),
            (
                _is_int(self.max_running) and self.max_running >= 1,
                "max_running must be an int >= 1",
            ),
            (
                self.stop_token is None or _is_int(self.stop_token),
                "stop_token must be None or an int",
            ),
            (_is_int(self.vocab) and self.vocab >= 1, "vocab must be an int >= 1"),
            (isinstance(self.prefix_caching, bool), "prefix_caching must be a bool"),
            (isinstance(self.async_scheduling, bool), "async_scheduling must be a bool"),
            (isinstance(self.sync_loads, bool), "sync_loads must be a bool"),
            (isinstance(self.load_last_block, bool), "load_last_block must be a bool"),
            (
                isinstance(self.delay_load_registration, bool),
                "delay_load_registration must be a bool",
            ),
            (isinstance(self.defer_free, bool), "defer_free must be a bool"),
            (
                self.sliding_window is None
                or (_is_int(self.sliding_window) and self.sliding_window >= 1),
                "sliding_window must be None or an int >= 1",
            ),
            (
                isinstance(self.defer_loads, bool) and (self.defer_free or not self.defer_loads),
                "defer_loads must be a bool, and needs defer_free",
            ),
            (
                self.stale_output in STALE_OUTPUTS,
                f"stale_output must be one of {', '.join(STALE_OUTPUTS)}",
            ),
            (
                _is_int(self.spec_tokens) and self.spec_tokens >= 0,
                "spec_tokens must be an int >= 0",
            ),
        )
        for ok, message in checks:
            if not ok:
                field = message.split()[0]
                raise ValueError(f"{message}, got {getattr(self, field)!r}")
        if self.slot_buffer not in SLOT_BUFFERS:
            raise ValueError(f"slot_buffer must be one of {', '.join(SLOT_BUFFERS)}")
        if self.slot_buffer != "no_buffer" and not any(g.kind == "slot" for g in self.groups):
            raise ValueError("slot_buffer extra_buffer needs a slot group")
        if self.groups:
            self._check_groups()

    def _check_groups(self) -> None:
        if not isinstance(self.groups, tuple) or not all(
            isinstance(g, GroupSpec) for g in self.groups
        ):
            raise ValueError(f"groups must be a tuple of GroupSpec, got {self.groups!r}")
        if self.sliding_window is not None:
            raise ValueError("groups and sliding_window are exclusive: give the window a group")
        if self.spec_tokens:
            raise ValueError("groups: speculative decoding is not modelled with groups")
        for i, g in enumerate(self.groups):
            where = f"groups[{i}]"
            if g.kind not in GROUP_KINDS:
                raise ValueError(f"{where}: kind must be one of {', '.join(GROUP_KINDS)}")
            if g.kind == "cross" and i == 0:
                raise ValueError(f"{where}: kind cross is never group 0: it follows a decoder's")
            if not (_is_int(g.block_size) and g.block_size >= 1):
                raise ValueError(f"{where}: block_size must be an int >= 1")
            if g.block_size % self.block_size:
                raise ValueError(
                    f"{where}: block_size {g.block_size} is not a multiple of the hash "
                    f"block size {self.block_size}"
                )
            if g.kind == "window":
                if not (_is_int(g.window) and g.window is not None and g.window >= 1):
                    raise ValueError(f"{where}: a window group needs a window, an int >= 1")
            elif g.window is not None:
                raise ValueError(f"{where}: only a window group has a window")
            if g.kind == "chunked":
                if not (_is_int(g.chunk) and g.chunk and g.chunk % g.block_size == 0):
                    raise ValueError(f"{where}: a chunked group's chunk is a multiple of its block")
            elif g.chunk is not None:
                raise ValueError(f"{where}: only a chunked group has a chunk")
            if g.registers is not None and (
                g.kind != "state" or g.registers not in STATE_REGISTRATIONS
            ):
                raise ValueError(
                    f"{where}: only a state group registers by a rule, one of "
                    f"{', '.join(STATE_REGISTRATIONS)}; got {g.registers!r}"
                )
        self._check_slots()

    def _check_slots(self) -> None:
        """A slot group follows a full group 0, its request's output is dropped when it is
        preempted under a step in flight, and with prefix caching it is cached only by the
        engine's own snapshots (``policy="engine-registers"``, ``slots.py``)."""
        kinds = [g.kind for g in self.groups]
        if "slot" not in kinds:
            return
        if kinds[0] == "slot":
            raise ValueError("groups[0]: a slot group is never group 0 (it follows a full group)")
        if self.slot_buffer == "extra_buffer" and (
            self.policy != "engine-registers" or self.depth > 1
        ):
            raise ValueError(
                "slot_buffer extra_buffer: track slots are the engine's own registration "
                "(engine-registers), at depth 1 (a submitted step's track write must not land "
                "in a track slot its request let go of)"
            )
        if self.stale_output == "deliver" and self.depth > 1:
            raise ValueError(
                "groups: a slot group with stale_output='deliver' under depth > 1: a preempted "
                "request's submitted step would read and write the slot it let go of "
                "(NoReadOfRecycled)"
            )
        if self.prefix_caching and self.policy != "engine-registers":
            raise ValueError(
                f"groups: a slot group under policy {self.policy!r} with prefix caching: its "
                "states are cached only by the engine's own snapshots (engine-registers)"
            )

    @property
    def grouped(self) -> bool:
        """The engine follows ``groups`` with the coordinator (``groups.GroupedKV``): several
        groups, a state group, or a group block size other than the hash block size."""
        groups = self.groups
        return bool(groups) and (
            len(groups) > 1
            or groups[0].kind in ("state", "chunked")
            or groups[0].block_size != self.block_size
        )

    @property
    def align(self) -> int:
        """The unit of a hit's length: the least common multiple of the groups' block sizes (but
        a cross group's, which hits nothing)."""
        out = self.block_size
        for g in self.groups:
            if g.kind == "cross":
                continue
            out = out * g.block_size // math.gcd(out, g.block_size)
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
