"""vLLM's real ``Scheduler``/``AsyncScheduler``, ``KVCacheManager`` and ``BlockPool``
through the adapter protocol (``kvspec fuzz --target kvspec.conformance.adapters.vllm_adapter:factory``).

Importable only where vLLM is installed: 0.33.0 or 0.34.0 (``make thirdparty`` builds
``.venv-vllm`` and ``.venv-vllm-0.34.0``; ``versions.py`` names what each release calls the
non-public names read here, ``cpu_platform.py`` builds 0.34.0's configs on a CPU). Nothing
of vLLM is reimplemented here: the adapter builds vLLM's own objects (one KV-cache group, full
attention, prefix caching on, chunked prefill), plays the engine core's loop and the model runner
(one sampled token per request whose chunk reached the end of its tokens, the token drawn by
Hypothesis through ``choices``), and turns what vLLM does into kvspec events by wrapping, on each
instance, the methods where the block lifecycle happens.

**The factories.** Depth D is vLLM's batch queue of D steps (``VllmConfig.max_concurrent_batches``;
``build.py`` says how each is configured) and ``step`` replays ``EngineCore.step_with_batch_queue``
call for call (``EngineCore.step`` at D = 1). Each factory returns an adapter whose ``config`` is
the spec's model of what it runs (``async_scheduling``, ``stale_output``), whatever the config it
was given said of those two fields: the fuzzer and ``kvspec check`` judge against that.

==========================  ================================================================
``factory``                 vLLM as ``vllm serve`` runs it on a GPU: D = 1 the synchronous
                            ``Scheduler`` (async scheduling off, as on a CPU or where it is
                            ruled out); D >= 2 ``AsyncScheduler`` with Model Runner V2 and
                            ``pipeline_parallel_size = D - 1`` (D = 2: the single-GPU default;
                            V2 keeps async scheduling on with pipeline parallelism, with PP + 1
                            steps in flight). Stale output delivered (vLLM's default).
``sync_factory``            ``--no-async-scheduling`` (or async ruled out: Model Runner V1 with
                            pipeline parallelism): the synchronous ``Scheduler``,
                            ``pipeline_parallel_size = D``; stale output delivered.
``drop_factory``            the synchronous ``Scheduler`` of ``sync_factory`` in drop mode.
``async_drop_factory``      ``factory``'s engine in drop mode.
``long_prefill_factory``    ``factory`` with ``--long-prefill-token-threshold`` at half the
                            token budget (at least 1): prefill chunks capped once two requests
                            are eligible. Not vLLM's default (0), but a documented serving
                            option, and the one setting under which the fuzzer reaches
                            ``docs/findings/vllm_async_chunked_prefill_zombie.py``.
``fresh_factory``           ``factory`` with nothing reused between examples: each builds its
                            own ``VllmConfig`` (``reuse.py``; the others reuse it unless
                            ``KVSPEC_VLLM_REUSE=0``).
``drafts_factory``          ``--spec-tokens K``: the synchronous ``Scheduler`` with n-gram
                            speculative decoding, K drafts per decode, at depth 1; the drafter
                            and the runner's acceptance drawn by the fuzzer (``drafts.py``).
                            The other factories refuse ``--spec-tokens``.
==========================  ================================================================

**Stale output.** With several steps in flight a request may be preempted while a submitted step
still holds it. The worker still computes it, and the runner returns its token as a real runner
does. vLLM 0.33.0 by default *delivers* that token to the preempted request
(``num_stale_output_tokens``: appended while it waits, and the request is not re-admitted until
every such output is in); in its *drop* mode (``requires_kv_delivery``, set by KV connectors that
need it) it drops the token and may re-admit at once. The spec models both
(``Config.stale_output``). ``self_check`` verifies that vLLM appended exactly the tokens the
``commit`` reports, each at the position it was sampled for.

Where each event comes from: ``attach.py``, whose public ``attach(scheduler)`` derives every event
(the engine core's decisions and the block lifecycle) from vLLM's own entry points on a scheduler
the caller built, and refuses, by feature name, what the spec does not model (``features.py``);
``loop.py`` only drives (the engine core's loop, the fake model runner); ``build.py`` makes vLLM's
objects, on a ``VllmConfig`` kept between the fuzzer's examples (``reuse.py`` says why only
that, and how to turn it off); ``kv_stream.py`` runs vLLM's KV-event publisher. ``pool_attach.attach_pool`` does the
same for a bare ``KVCacheManager`` or ``BlockPool``, in the pool machine's vocabulary (``kvspec.spec.pool_machine``). kvspec's pytest plugin
(``kvspec/pytest_plugin.py``) attaches both to whatever a vLLM test builds.

vLLM's native KV events (``BlockStored``/``BlockRemoved``) are kept and cross-checked:
``self_check`` (run by the fuzzer after every rule) says whether vLLM stored as many blocks as
the wrappers saw ``publish`` events and removed as many as they saw ``evict`` events, and whether
the blocks vLLM touched on each admission are the ``hit`` reported. vLLM's own
``ZmqEventPublisher`` sends them over loopback and the stream is judged against vLLM's cache at
every ``update_from_output`` (``kv_stream.py``, ``docs/kv-events.md``).

Judging is strict (``docs/adapters.md``): the spec models vLLM 0.33.0, so vLLM's effects must be
the spec's exactly, block ids and free-queue order included. One known difference cannot show
here: vLLM puts a freed batch of *unhashed* blocks at the head of its free queue in the order they
were freed, the spec one at a time (reversed); with eager registration only a table's last block
can be unhashed, so a free never holds two.
"""

from __future__ import annotations

import os

# vLLM resolves its platform at the first import that asks for it (this package's first import
# of vLLM): a CPU one here, whatever the wheel was built for (build.py, cpu_platform.py).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvspec.reference.choices import Choices  # noqa: E402
from kvspec.spec import Config  # noqa: E402

from .attach import Attachment, Refusal, attach, config_of  # noqa: E402
from .drafts import DraftsAdapter, drafts_factory  # noqa: E402
from .loop import VOCAB, VllmAdapter  # noqa: E402
from .pool_attach import PoolAttachment, attach_pool  # noqa: E402

__all__ = [
    "MAX_DEPTH",
    "VOCAB",
    "Attachment",
    "DraftsAdapter",
    "PoolAttachment",
    "Refusal",
    "VllmAdapter",
    "async_drop_factory",
    "attach",
    "attach_pool",
    "config_of",
    "drafts_factory",
    "drop_factory",
    "factory",
    "fresh_factory",
    "long_prefill_factory",
    "sync_factory",
]

MAX_DEPTH = 4
"""Batch queues of 1 (``EngineCore.step``) to MAX_DEPTH steps (``build.py``)."""


def supported(config: Config, drafts: bool = False) -> str | None:
    """Why vLLM cannot run this cell, or None. ``drafts``: the factory runs speculative
    decoding (``drafts_factory``); the others refuse draft tokens rather than run without."""
    if config.policy != "eager-unsafe":
        return f"vLLM (0.33.0, 0.34.0) registers eagerly and never rolls back: policy eager-unsafe, not {config.policy}"
    if config.discipline != "vllm":
        return f"vLLM's scheduler is the vllm discipline, not {config.discipline}"
    if config.depth > MAX_DEPTH:
        return f"the adapter runs vLLM at depth 1 to {MAX_DEPTH}, not depth {config.depth}"
    if config.stop_token not in (None, 0):
        return f"the fake model runner's stop token is 0, not {config.stop_token}"
    if config.spec_tokens and not drafts:
        return "draft tokens (--spec-tokens) run through vllm_adapter:drafts_factory"
    if config.sliding_window is not None:
        return "the vLLM factories run one full-attention group, not a sliding window"
    return None


def _adapter(
    config: Config,
    choices: Choices,
    asynchronous: bool,
    drop: bool,
    threshold: int = 0,
    reuse: bool | None = None,
) -> VllmAdapter:
    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return VllmAdapter(
        config,
        choices,
        drop_stale=drop,
        async_scheduling=asynchronous,
        long_prefill_token_threshold=threshold,
        reuse=reuse,
    )


def factory(config: Config, choices: Choices) -> VllmAdapter:
    """The adapter factory named on the command line: vLLM's defaults on a GPU (async
    scheduling from depth 2, stale output delivered)."""
    return _adapter(config, choices, asynchronous=config.depth >= 2, drop=False)


def fresh_factory(config: Config, choices: Choices) -> VllmAdapter:
    """``factory`` building its own ``VllmConfig`` for every example (``reuse.py``)."""
    return _adapter(config, choices, asynchronous=config.depth >= 2, drop=False, reuse=False)


def sync_factory(config: Config, choices: Choices) -> VllmAdapter:
    """vLLM with async scheduling off: the synchronous ``Scheduler``, a batch queue of depth
    steps (pipeline parallelism), stale output delivered."""
    return _adapter(config, choices, asynchronous=False, drop=False)


def drop_factory(config: Config, choices: Choices) -> VllmAdapter:
    """``sync_factory`` in vLLM's drop mode: the stale output of a preempted request is dropped
    by vLLM and the request may resume at once (``requires_kv_delivery``)."""
    return _adapter(config, choices, asynchronous=False, drop=True)


def async_drop_factory(config: Config, choices: Choices) -> VllmAdapter:
    """``factory`` in vLLM's drop mode."""
    return _adapter(config, choices, asynchronous=config.depth >= 2, drop=True)


def long_prefill_factory(config: Config, choices: Choices) -> VllmAdapter:
    """``factory`` with ``long_prefill_token_threshold`` at half the token budget (at least 1):
    a running request's prefill is cut into chunks of that size while another request waits or
    runs, so a request can sit mid-prefill ahead of one that fails to allocate."""
    threshold = max(1, config.token_budget // 2)
    return _adapter(config, choices, config.depth >= 2, drop=False, threshold=threshold)
