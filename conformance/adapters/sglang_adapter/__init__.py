"""SGLang 0.5.23's scheduler and memory objects through the adapter protocol, in the order of its
default *overlap* event loop (``kvspec fuzz --target kvspec.conformance.adapters.sglang_adapter:factory
--depth 2``) or of its loop without overlap (``...:sync_factory``, depth 1).

Importable only where SGLang 0.5.23 is installed (``make thirdparty`` builds ``.venv-sglang``).
The adapter runs SGLang's own ``Req``, ``ScheduleBatch`` (``prepare_for_extend``,
``prepare_for_decode``, ``check_decode_mem``, ``retract_decode``, ``filter_batch``,
``merge_batch``), ``PrefillAdder``, ``SchedulePolicy``, ``NewTokenRatioTracker``, the tree cache
SGLang's ``create_tree_cache`` builds (``UnifiedRadixCache``, FULL component, Rust ``TreeCore``;
``python_core_factory`` and ``legacy_factory`` name the others, ``build.TREES``;
``retract_factory`` runs SGLang's retraction test mode, ``SGLANG_TEST_RETRACT``; ``swa_factory``,
``swa_sync_factory`` and ``swa_retract_factory`` the FULL + SWA tree of a hybrid sliding-window
model, ``swa.py``; ``mamba_factory`` the FULL + MAMBA tree of a hybrid linear-attention model,
``mamba.py``; ``mamba_extra_factory`` Qwen3-Next's ``extra_buffer`` under overlap, ``extra.py``),
``PagedTokenToKVPoolAllocator`` and ``ReqToTokenPool``, and the memory path of its ``Scheduler``
methods line for line (``scheduler.py``, with SGLang's line numbers); it plays the model runner
and draws each sampled token from ``choices``. Modules: ``build`` (SGLang's import on a CPU,
its objects), ``record`` (the wrappers that turn SGLang's tree operations into events),
``scheduler`` (the scheduler's methods), ``loops`` (the two event loops and the protocol),
``mutants`` (wrong orders the judge must catch).

Where the overlap loop touches the tree and the pools (``managers/scheduler.py``, 0.5.23):

* ``get_next_batch_to_run`` (3894) forms batch N+1 while N's forward may run: first the chunked
  request's previous chunk, written by forward N, is inserted (line 3919,
  ``stash_chunked_request`` 3772: ``checkpoint_kv_cache``); then batch N, if a prefill, is merged
  into the running batch *before* its result is processed (3934-3961; "overlap merges a prefill's
  requests before its result finishes them", 3963), so N+1 may decode them on the token N samples;
* ``_get_new_batch_prefill_raw`` (4079) admits and chunks with ``PrefillAdder`` (4184, 4270) and
  allocates in ``prepare_for_extend`` (4357); ``update_running_batch`` (4459) leaves out the
  requests N finishes by length (``_reqs_finishing_inflight`` 4444, called at 4463), retracts when
  the decode does not fit (``retract_decode`` 4493: ``release_req`` -> ``release_kv_cache``, pages
  forward N may still read) and allocates each decode's slot (``prepare_for_decode`` 4551), its
  input the future token of N;
* ``run_batch`` (4614) launches N+1; then ``pop_and_process`` (2068, called at 2120) processes N
  (``batch_result_processor.py``): a finished request is inserted and released
  (``release_kv_cache(checkpoint=True)``, 387 and 1466; its row includes the slot N+1 writes), a
  non-chunked prefill that goes on is inserted (``checkpoint_kv_cache`` 394) while N+1 already
  decodes it, and a request finished or retracted since is skipped (1022-1027).

How SGLang maps onto the spec (``docs/adapters.md``): policy ``engine-registers`` (SGLang inserts
into its tree on its own and deduplicates on insert), discipline ``general``, preemption ``fcfs``,
judged *observed*; the overlap loop at depth 2 with ``async_scheduling`` (placeholder tokens), the
loop without overlap at depth 1. A page's refcount is its tree node's ``lock_ref`` or, outside the
tree, the rows holding it; the free set is the allocator's free pages and the unlocked tree pages.

Left to the adapter, none of it SGLang's memory logic: a request's ``max_tokens`` is clipped at
arrival by SGLang's ``max_new_tokens_for_memory`` (its ``arrive`` carries the clipped value); a
client abort of a running request finishes it at its next result, as SGLang does, but after the
other requests of that result (the spec's ``abort`` follows the ``commit``); when even the last
decoding request does not fit, SGLang aborts it while forming the batch, which the adapter reports
just before that step's ``begin`` (the spec's ``abort`` is illegal while a step is building).
"""

from __future__ import annotations

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from .loops import SglangAdapter

__all__ = [
    "SglangAdapter",
    "factory",
    "legacy_factory",
    "legacy_sync_factory",
    "python_core_factory",
    "retract_factory",
    "supported",
    "mamba_factory",
    "mamba_retract_factory",
    "mamba_extra_factory",
    "mamba_extra_retract_factory",
    "mamba_extra_fixed_factory",
    "swa_factory",
    "swa_retract_factory",
    "swa_sync_factory",
    "sync_factory",
]


def supported(config: Config, overlap: bool = True) -> str | None:
    """Why the SGLang adapter cannot run this cell in this loop, or None."""
    if config.policy != "engine-registers":
        return (
            "SGLang inserts pages into its radix tree after a prefill's result and at finish, and "
            f"deduplicates: policy engine-registers, not {config.policy}"
        )
    if config.discipline != "general":
        return f"SGLang retracts the request with the fewest outputs: discipline general, not {config.discipline}"
    if config.preemption != "fcfs":
        return "SGLang's default scheduling and retraction ignore priorities: preemption fcfs"
    if config.stop_token not in (None, 0):
        return f"the fake model runner's stop token is 0, not {config.stop_token}"
    if config.sliding_window is not None:
        return (
            "SGLang serves a sliding-window model with UnifiedRadixCache's SWA component beside "
            "FULL (a second pool, per-component locks and eviction, window tombstones): two "
            "KV-cache groups, not the spec's one sliding-window group: sliding_window refused "
            "(swa_factory runs SGLang's hybrid SWA model; docs/adapters.md, SGLang, hybrid models)"
        )
    if config.spec_tokens:
        return "the SGLang adapter drives no speculative decoding: spec_tokens 0"
    if config.defer_free or config.defer_loads or config.delay_load_registration:
        return "defer_free, defer_loads and delay_load_registration are vLLM's, not SGLang's"
    if not config.prefix_caching:
        return "the SGLang adapter drives SGLang's radix tree cache: prefix caching on"
    if overlap and config.depth != 2:
        return (
            "SGLang's default overlap scheduler keeps a batch in flight while it forms the next: "
            f"depth 2, not {config.depth} (sync_factory runs it without overlap, depth 1)"
        )
    if not overlap and config.depth != 1:
        return f"SGLang without overlap runs one batch at a time: depth 1, not {config.depth}"
    return None


def _build(
    config: Config, choices: Choices, overlap: bool, tree: str, test_retract: bool | None = None
) -> SglangAdapter:
    why = supported(config, overlap)
    if why is not None:
        raise ValueError(why)
    return SglangAdapter(config, choices, overlap=overlap, tree=tree, test_retract=test_retract)


def factory(config: Config, choices: Choices) -> SglangAdapter:
    """SGLang as it runs by default: the overlap scheduler (depth 2, placeholder decodes) over the
    tree cache SGLang's ``create_tree_cache`` builds for a plain model (``UnifiedRadixCache``,
    FULL component, Rust ``TreeCore``)."""
    return _build(config, choices, True, "unified")


def sync_factory(config: Config, choices: Choices) -> SglangAdapter:
    """SGLang with ``--disable-overlap-schedule`` (depth 1), its default tree cache."""
    return _build(config, choices, False, "unified")


def retract_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``factory`` in SGLang's own retraction test mode (``SGLANG_TEST_RETRACT=1``: every
    ``SGLANG_TEST_RETRACT_INTERVAL``-th batch, 3 by default, retracts decoding requests as a full
    pool would): the fuzzer's pools, a few pages, rarely run SGLang's decodes out of memory,
    since its admission reserves each new request's whole ``max_new_tokens`` (docs/adapters.md)."""
    return _build(config, choices, True, "unified", test_retract=True)


def python_core_factory(config: Config, choices: Choices) -> SglangAdapter:
    """The overlap scheduler over ``UnifiedRadixCache`` with SGLang's Python ``TreeCore``
    (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``), whose lock counts the adapter reads."""
    return _build(config, choices, True, "python-core")


def swa_factory(config: Config, choices: Choices) -> SglangAdapter:
    """The overlap scheduler over the tree cache SGLang builds for a hybrid sliding-window model
    (``build.SWA_MODEL``: ``UnifiedRadixCache`` with FULL and SWA, Rust ``TreeCore``; two pools of
    the cell's ``num_blocks - 1`` pages each), its events those of two KV-cache groups (``swa.py``:
    a request's SWA table the window its tree lock holds and its own pages not yet freed)."""
    return _build_swa(config, choices, True)


def swa_sync_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``swa_factory`` without overlap (depth 1)."""
    return _build_swa(config, choices, False)


def swa_retract_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``swa_factory`` in SGLang's retraction test mode (``retract_factory``): the seed's
    question for an engine that registers on its own, whether it publishes a block whose writer
    it retracted, asked of the hybrid tree."""
    why = swa_refusal(config, True)
    if why is not None:
        raise ValueError(why)
    return SglangAdapter(config, choices, overlap=True, tree="swa", test_retract=True)


MAMBA_REFUSAL = (
    "SGLang's MAMBA component copies recurrent states between whole-state slots (a hit's state "
    "into the request's own slot, copy-on-write; a running request's state into a fresh slot "
    "the tree keeps, at an insert), and this spec has no slot group kind (a state in one slot "
    "per request, cached by copy: snapshot): MAMBA refused (docs/adapters.md, SGLang, hybrid "
    "models)"
)
"""Why ``mamba_factory`` refuses where the spec has no ``slot`` group kind."""


def mamba_refusal(config: Config) -> str | None:
    """Why ``mamba_factory`` cannot run this cell, or None: the cell the loop without overlap
    refuses (SGLang's auto strategy forces it for the model, ``mamba.py``), groups set by hand,
    or a spec without the slot kind. The cell's pages become pages of 1 token
    (``loops.hybrid_mamba_config``: no_buffer asserts them)."""
    from .loops import spec_has_slot

    why = supported(config, overlap=False)
    if why is not None:
        return why
    if getattr(config, "groups", ()):
        return "mamba_factory sets the groups from SGLang's model: leave groups empty"
    if not spec_has_slot():
        return MAMBA_REFUSAL
    return None


def mamba_retract_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``mamba_factory`` in SGLang's retraction test mode (``retract_factory``): a retracted
    request's slot goes back to the allocator, unpublished (its state is not inserted)."""
    why = mamba_refusal(config)
    if why is not None:
        raise ValueError(why)
    return SglangAdapter(config, choices, overlap=False, tree="mamba", test_retract=True)


def mamba_factory(config: Config, choices: Choices) -> SglangAdapter:
    """SGLang's tree for a hybrid linear-attention model (``mamba.MAMBA_MODEL``:
    ``UnifiedRadixCache`` with FULL and MAMBA over a ``HybridReqToTokenPool``), as its ``auto``
    strategy resolves it: ``no_buffer``, which forces the loop without overlap (depth 1); its
    events those of a full group and a slot group (``mamba.py``). ``extra_buffer`` is
    ``mamba_extra_factory``'s."""
    why = mamba_refusal(config)
    if why is not None:
        raise ValueError(why)
    return SglangAdapter(config, choices, overlap=False, tree="mamba")


def mamba_extra_refusal(config: Config) -> str | None:
    """Why ``mamba_extra_factory`` cannot run this cell, or None: the cell the overlap loop
    refuses (depth 2), groups set by hand, a spec without the slot kind, or SGLang resolving
    ``EXTRA_MODEL`` to anything but ``extra_buffer``."""
    from . import mamba
    from .loops import spec_has_slot

    why = supported(config, overlap=True)
    if why is not None:
        return why
    if getattr(config, "groups", ()):
        return "mamba_extra_factory sets the groups from SGLang's model: leave groups empty"
    if not spec_has_slot():
        return MAMBA_REFUSAL
    strategy = dict(mamba.extra_resolved()).get("mamba_radix_cache_strategy")
    if strategy != "extra_buffer":
        return f"SGLang resolves {mamba.EXTRA_MODEL['architectures'][0]} to {strategy}"
    return None


def mamba_extra_factory(config: Config, choices: Choices) -> SglangAdapter:
    """SGLang's tree for Qwen3-Next (``mamba.EXTRA_MODEL``) as its ``auto`` strategy resolves it
    under the overlap loop: ``extra_buffer``, depth 2, each request's working slot and ping-pong
    track slots a slot table of the spec's track slots (``extra.py``)."""
    return _extra(config, choices, fixed=False, test_retract=None)


def mamba_extra_fixed_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``mamba_extra_factory`` with the ping-pong flip SGLang 0.5.23 misses after a prefill
    (``extra.FlippedScheduler``): the run the rest of ``extra_buffer`` is judged on."""
    return _extra(config, choices, fixed=True, test_retract=None)


def mamba_extra_retract_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``mamba_extra_factory`` in SGLang's retraction test mode (``retract_factory``)."""
    return _extra(config, choices, fixed=False, test_retract=True)


def mamba_extra_fixed_retract_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``mamba_extra_fixed_factory`` in SGLang's retraction test mode."""
    return _extra(config, choices, fixed=True, test_retract=True)


def _extra(
    config: Config, choices: Choices, fixed: bool, test_retract: bool | None
) -> SglangAdapter:
    """The ``extra_buffer`` factories: refused by name where ``mamba_extra_refusal`` says so,
    else ``extra.ExtraAdapter`` (``FixedAdapter`` with the flip made)."""
    why = mamba_extra_refusal(config)
    if why is not None:
        raise ValueError(why)
    from .extra import ExtraAdapter, FixedAdapter

    return (FixedAdapter if fixed else ExtraAdapter)(config, choices, test_retract=test_retract)


def swa_refusal(config: Config, overlap: bool = True) -> str | None:
    """Why the SWA factories cannot run this cell, or None: the cell ``supported`` refuses, or
    a spec without an engine's per-group effects (``loops.spec_follows_groups``) or without its
    own let-go of window blocks (``loops.spec_takes_let_go``)."""
    from .loops import SWA_REFERENCES, spec_follows_groups, spec_takes_let_go

    why = supported(config, overlap)
    if why is not None:
        return why
    if getattr(config, "groups", ()):
        return "the SWA factories set the groups from SGLang's model: leave groups empty"
    if not spec_follows_groups():
        return (
            "a hybrid SWA model's events are those of two KV-cache groups, and this spec does "
            "not follow several groups for an engine that registers on its own yet "
            "(docs/hybrid.md; docs/adapters.md, SGLang, hybrid models)"
        )
    if not spec_takes_let_go():
        return SWA_REFERENCES
    return None


def _build_swa(config: Config, choices: Choices, overlap: bool) -> SglangAdapter:
    why = swa_refusal(config, overlap)
    if why is not None:
        raise ValueError(why)
    return SglangAdapter(config, choices, overlap=overlap, tree="swa")


def legacy_factory(config: Config, choices: Choices) -> SglangAdapter:
    """The overlap scheduler over the legacy ``RadixCache``, which SGLang built by default before
    ``UnifiedRadixCache`` (and which its other tree caches still derive from)."""
    return _build(config, choices, True, "legacy")


def legacy_sync_factory(config: Config, choices: Choices) -> SglangAdapter:
    """``legacy_factory`` without overlap (depth 1)."""
    return _build(config, choices, False, "legacy")
