"""vLLM 0.33.0's real ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` through the adapter
protocol (``kvspec fuzz --target kvspec.conformance.adapters.vllm_adapter:factory``).

Importable only where vLLM 0.33.0 is installed (``make thirdparty`` builds ``.venv-vllm``). Nothing
of vLLM is reimplemented here: the adapter builds vLLM's own objects (one KV-cache group, full
attention, prefix caching on, chunked prefill, the synchronous ``Scheduler``), plays the engine
core's loop and the model runner (one sampled token per request that reached the end of its known
tokens, the token drawn by Hypothesis through ``choices``), and turns what vLLM does into kvspec
events by wrapping, on each instance, the methods where the block lifecycle happens.

**Depth.** Depth D is vLLM's batch queue of D steps: ``pipeline_parallel_size = D`` (so
``VllmConfig.max_concurrent_batches == D``) and ``step`` replays ``EngineCore.step_with_batch_queue``
call for call: schedule a step and submit it, return at once while the queue has room and something
was scheduled or is schedulable, else pop the oldest step and ``update_from_output`` it. Aborts may
come between a step's scheduling and the processing of the oldest output (vLLM's aborts queue is
drained just before ``update_from_output``). At D = 1 this is ``EngineCore.step``. ``async_factory``
runs async scheduling instead (``AsyncScheduler``, a queue of 2, the same loop), whose decodes
are scheduled before their token is known (placeholders): the spec cannot judge that yet
(``docs/adapters.md``).

**Stale output.** With several steps in flight a request may be preempted while a submitted step
still holds it. The worker still computes it; vLLM 0.33.0 by default *delivers* the token sampled
there to the preempted request (``num_stale_output_tokens``) and does not re-admit the request
until that output is in; in its *drop* mode (``requires_kv_delivery``, set by KV connectors that
need it) it drops that output and may re-admit at once. The spec discards such a token and admits
in queue order, which is vLLM's drop mode. ``drop_factory`` runs vLLM in drop mode (a faithful
model runner). ``factory`` keeps vLLM's default, and its model runner *withholds* the stale token
(an empty sample, as for a prefill chunk): the one place where the adapter departs from a real
runner, so that the spec can judge the rest; at depth >= 3 vLLM's deferral of such a request's
re-admission still differs from the spec's queue order (an ``Illegal`` admission, not a safety
finding). ``self_check`` verifies that vLLM appended exactly the tokens the ``commit`` reports, each
at the position it was sampled for.

Where each event comes from: ``attach.py`` (the block lifecycle, wrapped on vLLM's own methods)
and ``loop.py`` (the engine core's decisions, the fake model runner); ``build.py`` makes vLLM's
objects; ``kv_stream.py`` runs vLLM's KV-event publisher.

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

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from .loop import VOCAB, VllmAdapter

__all__ = ["MAX_DEPTH", "VOCAB", "VllmAdapter", "async_factory", "drop_factory", "factory"]

MAX_DEPTH = 4
"""Batch queues of 1 (``EngineCore.step``) to MAX_DEPTH steps (pipeline parallelism)."""


def supported(config: Config) -> str | None:
    """Why vLLM cannot run this cell, or None."""
    if config.policy != "eager-unsafe":
        return f"vLLM 0.33.0 registers eagerly and never rolls back: policy eager-unsafe, not {config.policy}"
    if config.discipline != "vllm":
        return f"vLLM's scheduler is the vllm discipline, not {config.discipline}"
    if config.depth > MAX_DEPTH:
        return f"the adapter runs vLLM at depth 1 to {MAX_DEPTH}, not depth {config.depth}"
    if config.stop_token not in (None, 0):
        return f"the fake model runner's stop token is 0, not {config.stop_token}"
    return None


def factory(config: Config, choices: Choices) -> VllmAdapter:
    """The adapter factory named on the command line: vLLM's defaults (stale output of a
    preempted request is delivered; the runner withholds it)."""
    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return VllmAdapter(config, choices)


def drop_factory(config: Config, choices: Choices) -> VllmAdapter:
    """vLLM in its drop mode: the stale output of a preempted request is dropped by vLLM
    and the request may resume at once (``requires_kv_delivery``)."""
    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return VllmAdapter(config, choices, drop_stale=True)


def async_factory(config: Config, choices: Choices) -> VllmAdapter:
    """vLLM's async scheduling (``AsyncScheduler``, a batch queue of 2): depth 2 only. The spec
    cannot judge its placeholder decodes yet (``docs/adapters.md``)."""
    why = supported(config)
    if why is None and config.depth != 2:
        why = f"async scheduling keeps 2 steps in flight: depth 2, not {config.depth}"
    if why is not None:
        raise ValueError(why)
    return VllmAdapter(config, choices, async_scheduling=True)
