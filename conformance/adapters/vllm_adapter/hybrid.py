"""vLLM's hybrid models (several KV-cache groups, issue #36): their schedulers, their groups as
the trace header names them, and what of them kvspec cannot follow yet, refused by name.

Two models, each a small ``config.json`` this module writes (no weights: the scheduler needs
none), with vLLM's defaults otherwise (prefix caching on, chunked prefill, async scheduling from
a batch queue of two steps, the Mamba cache mode vLLM picks):

* ``swa``: a Gemma 3 text model (``Gemma3ForCausalLM``), one sliding-window layer of window
  ``WINDOW_BLOCKS`` blocks beside one full-attention layer;
* ``swa-full-first``: the same Gemma 3 model with its full-attention layer first, so that vLLM,
  which orders the groups by the layers, puts the window in group 1, where ``NoReadOfRecycled``
  judges it (group 0's window is ``NoUnwrittenRead``'s window clause);
* ``mamba``: a Qwen3-Next model (``Qwen3NextForCausalLM``), one full-attention layer, then one
  gated-delta-net (linear attention, a Mamba-type state) layer. With prefix caching on,
  vLLM's ``MambaModelConfig`` picks the ``align`` cache mode and a Mamba block of the block size.

The engine core asks the model runner for each layer's KV-cache spec, groups the layers
(``get_kv_cache_groups``) and resolves the scheduler's and the hash's block sizes
(``resolve_kv_cache_block_sizes``). No model runner is built here: ``layer_specs`` states each
layer's spec as vLLM's layers state it from the config (attention: ``FullAttentionSpec`` or
``SlidingWindowSpec`` of the config's window; the gated delta net: a ``MambaSpec`` of the state
shapes and dtypes vLLM's ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator`` give, of
the cache's Mamba block size and mode), and the rest is vLLM's own code, as ``EngineCore`` runs
it.

How the attachments read several groups (the header's ``model.groups``, the events' group
field, what is refused by name) is ``groups.py``'s.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from functools import cache
from typing import Any

from vllm.config import (
    VllmConfig,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvspec.conformance.kvevents.engine_stream import chosen_known
from kvspec.conformance.kvevents.known_findings import MAMBA_STORE_TOKENS
from kvspec.reference.choices import Choices
from kvspec.spec import Config

from . import groups, versions
from . import reuse as reuse_
from .loop import VllmAdapter

MODELS = ("swa", "swa-full-first", "mamba")
WINDOW_BLOCKS = 1
"""The ``swa`` model's window, in blocks of the cell's block size: one, so that the fuzzer's
pools (a request of at most three blocks per group) reach window blocks skipped and freed while
the request shares blocks of the full group (with two, a request skips none before its last
token)."""

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "num_hidden_layers": 2,
}


def model_config_json(model: str, block_size: int) -> dict[str, Any]:
    """The ``config.json`` of a hybrid model: ``swa`` or ``mamba`` (module docstring)."""
    if model in ("swa", "swa-full-first"):
        layers = ["sliding_attention", "full_attention"]
        return _COMMON | {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "sliding_window": WINDOW_BLOCKS * block_size,
            "layer_types": layers if model == "swa" else layers[::-1],
            "query_pre_attn_scalar": 32,
            "rope_local_base_freq": 10000.0,
        }
    if model == "mamba":
        return _COMMON | {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            # full attention first: vLLM orders the groups by the layers, and the spec's group 0
            # is a full or window group (its hit is the coordinator's first, downward-closed)
            "layer_types": ["full_attention", "linear_attention"],
            "full_attention_interval": 2,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 1,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 1,
        }
    raise ValueError(f"no hybrid model {model!r}; there are {', '.join(MODELS)}")


@cache
def model_folder(model: str, block_size: int) -> str:
    """A folder holding only the model's ``config.json`` (all ``ModelConfig`` reads)."""
    folder = tempfile.mkdtemp(prefix=f"kvspec-vllm-{model}-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model_config_json(model, block_size), f)
    return folder


def layer_specs(vconfig: VllmConfig) -> dict[str, KVCacheSpec]:
    """Each layer's KV-cache spec, as the model's layers state it (module docstring)."""
    hf = vconfig.model_config.hf_config
    cache = vconfig.cache_config
    bsz, dtype = cache.block_size, vconfig.model_config.dtype
    heads, head = hf.num_key_value_heads, hf.head_dim
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(hf.layer_types):
        name = f"model.layers.{i}"
        if kind == "full_attention":
            specs[name] = FullAttentionSpec(bsz, num_kv_heads=heads, head_size=head, dtype=dtype)
        elif kind == "sliding_attention":
            specs[name] = SlidingWindowSpec(
                bsz,
                num_kv_heads=heads,
                head_size=head,
                dtype=dtype,
                sliding_window=hf.sliding_window,
            )
        elif kind == "linear_attention":
            specs[name] = _gated_delta_net_spec(vconfig)
        else:
            raise ValueError(f"layer {i}: no KV-cache spec for {kind!r}")
    return specs


def _gated_delta_net_spec(vconfig: VllmConfig) -> MambaSpec:
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    hf, cache = vconfig.model_config.hf_config, vconfig.cache_config
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1,
        hf.linear_num_key_heads,
        hf.linear_num_value_heads,
        hf.linear_key_head_dim,
        hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim,
    )
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        vconfig.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
    )
    assert cache.mamba_block_size is not None
    return MambaSpec(
        shapes=tuple(shapes),
        dtypes=tuple(dtypes),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_cache_mode=cache.mamba_cache_mode,
    )


def new_vllm_config(
    model: str,
    num_blocks: int,
    block_size: int,
    budget: int,
    max_running: int,
    policy: str,
    depth: int,
    async_scheduling: bool,
    long_prefill_token_threshold: int = 0,
    prefix_caching: bool = True,
) -> VllmConfig:
    """vLLM's config of a hybrid model's cell: ``build.new_vllm_config``'s, of this model."""
    from .build import new_vllm_config as plain

    return plain(
        num_blocks,
        block_size,
        budget,
        max_running,
        policy,
        depth,
        async_scheduling,
        long_prefill_token_threshold,
        prefix_caching,
        model_folder=model_folder(model, block_size),
    )


def kv_cache_config_of(vconfig: VllmConfig, num_blocks: int) -> tuple[KVCacheConfig, int, int]:
    """The scheduler's ``KVCacheConfig`` of ``num_blocks`` shared blocks, its block size and
    its hash block size, as ``EngineCore`` resolves them from the layers' specs."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    specs = layer_specs(vconfig)
    if vconfig.cache_config.kv_cache_layout is None:
        # the workers' backends report the layouts they support; with none declared (no model
        # runner here) vLLM's default preference is what a worker reports
        supported = [layout.name for layout in get_supported_kv_cache_layouts([])]
        resolve_kv_cache_layout(vconfig, [supported], list(specs.values()))
    groups = get_global_kv_cache_groups(vconfig, [specs])
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(
        kv_cache_config, vconfig
    )
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = kv_cache_utils.resolve_cache_hit_alignment_tokens(
        kv_cache_config, vconfig, block_size, hash_block_size
    )
    return kv_cache_config, block_size, hash_block_size


def scheduler_on(vconfig: VllmConfig, num_blocks: int, async_scheduling: bool) -> Any:
    """vLLM's ``Scheduler`` (``AsyncScheduler``) of a hybrid model on ``vconfig``."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from .build import runner_v2

    kv_cache_config, block_size, hash_block_size = kv_cache_config_of(vconfig, num_blocks)
    with runner_v2(async_scheduling):
        scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
            vllm_config=vconfig,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vconfig),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
    assert versions.uses_runner_v2(scheduler) or not async_scheduling
    return scheduler


def build_scheduler(
    model: str, config: Config, async_scheduling: bool, threshold: int = 0, reuse: bool = True
) -> Any:
    """``build.build_scheduler`` for a hybrid model: its ``VllmConfig`` kept per cell and model
    (``reuse.py``), its groups over ``config.num_blocks`` shared blocks."""
    key = (config.num_blocks, config.block_size, config.token_budget, config.max_running)
    key += (config.preemption, config.depth, async_scheduling, threshold, config.prefix_caching)
    built = lambda: new_vllm_config(model, *key)  # noqa: E731
    vconfig = reuse_.configs.get((model, *key), built) if reuse else built()
    return scheduler_on(vconfig, config.num_blocks, async_scheduling)


class HybridVllmAdapter(VllmAdapter):
    """``VllmAdapter`` over a hybrid model's scheduler; its ``config`` names the groups vLLM
    made (``groups.spec_groups``), whatever the config it was given said of them."""

    model: str
    streams_kv_events = True
    """vLLM's per-group KV events are judged as a plain model's are (``kv_stream.py``): the
    stream judge keys its view by ``(medium, group, hash)`` and asks announced parents only of
    full-attention groups (``spec.stream.CHAINED_KINDS``: a window's store may follow a nulled,
    evicted block). With a Mamba state group (``MambaAdapter``) the stream is judged with one
    known vLLM finding read by name (``known_stream_findings``)."""
    known_stream_findings: tuple[str, ...] = ()
    """Known findings (``kvevents/known_findings.py``) this model's stream is read with, unless
    ``KVSPEC_KV_STREAM_KNOWN`` says otherwise (``engine_stream.chosen_known``)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        if self.kv_stream is not None:
            self.kv_stream.engine.know(chosen_known(self.known_stream_findings))

    def build_scheduler(
        self, config: Config, async_scheduling: bool, threshold: int, reuse: bool
    ) -> Any:
        scheduler = build_scheduler(self.model, config, async_scheduling, threshold, reuse)
        self.config = replace(self.config, **groups.spec_groups(scheduler))
        return scheduler


def _hybrid(model: str, config: Config, choices: Choices) -> VllmAdapter:
    from . import supported

    why = supported(config)
    if why is None and config.sliding_window is not None:
        why = "a hybrid model's window is its config.json's (hybrid.WINDOW_BLOCKS), not --window"
    if why is None and not groups.SPEC_FOLLOWS_GROUPS:
        why = (
            f"hybrid KV-cache groups: vLLM's {model} model has several groups and this build's "
            "spec has no Config.groups (issue #36)"
        )
    if why is not None:
        raise ValueError(why)
    return ADAPTERS[model](config, choices, async_scheduling=config.depth >= 2)


class SwaAdapter(HybridVllmAdapter):
    model = "swa"


class SwaFullFirstAdapter(HybridVllmAdapter):
    model = "swa-full-first"


class MambaAdapter(HybridVllmAdapter):
    model = "mamba"
    known_stream_findings = (MAMBA_STORE_TOKENS,)
    """A Mamba ``align`` group's ``BlockStored`` lists the tokens of the null blocks it skips
    beside the hashes of the blocks it keeps, with no offsets: a known vLLM finding
    (``docs/findings/README.md``, "vLLM: a Mamba group's ``BlockStored`` has more tokens than
    hashes"; vLLM issue #44451, PR #44488). The judge reads each such store by name as vLLM
    means it (each hash the block the full-attention group announced under it), counts it, and
    judges the rest of the stream; ``KVSPEC_KV_STREAM_KNOWN=`` (empty) reports it instead, as
    ``StoreConsistent``, and so does ``kvspec check --kv-events`` on its capture unless told
    ``--known vllm-mamba-store-tokens``."""


ADAPTERS: dict[str, type[HybridVllmAdapter]] = {
    "swa": SwaAdapter,
    "swa-full-first": SwaFullFirstAdapter,
    "mamba": MambaAdapter,
}
"""Each model's adapter class (``MODELS``)."""


def swa_factory(config: Config, choices: Choices) -> VllmAdapter:
    """vLLM serving the ``swa`` model (module docstring): a sliding-window group beside a
    full-attention one, async scheduling from depth 2, stale output delivered."""
    return _hybrid("swa", config, choices)


def swa_full_first_factory(config: Config, choices: Choices) -> VllmAdapter:
    """vLLM serving the ``swa-full-first`` model (module docstring): ``swa_factory``'s groups in
    the other order, the window second."""
    return _hybrid("swa-full-first", config, choices)


def mamba_factory(config: Config, choices: Choices) -> VllmAdapter:
    """vLLM serving the ``mamba`` model (module docstring): a gated-delta-net state group in
    ``align`` mode beside a full-attention one, async scheduling from depth 2."""
    return _hybrid("mamba", config, choices)
