"""SGLang 0.5.23's own objects on a CPU machine: its import without patching a file of SGLang, the
process-wide settings its helpers read, and the memory objects and requests the adapter drives.

Owns everything that touches SGLang's import machinery, so that the other modules of the adapter
import SGLang's names from here and read as plain uses of them.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from array import array
from typing import Any

_found = importlib.util.find_spec("sglang")
if _found is None or not _found.submodule_search_locations:
    raise ImportError(
        "the SGLang adapter needs sglang==0.5.23: run `make thirdparty` and use .venv-sglang/bin/kvspec"
    )


class _Absent(types.ModuleType):
    """A module that is not installed: any attribute is another absent module, a call fails."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.__name__}: torchvision is not installed")


def _import_sglang() -> None:
    """Import SGLang's scheduler and memory modules on a CPU machine without patching a file:

    * the package ``sglang`` as a bare package object, without its ``__init__`` (which imports the
      frontend language, its HTTP backends and Hugging Face patches), as for nano-vllm;
    * ``torchvision`` absent for the time of the import: ``memory_pool`` imports
      ``sglang.srt.configs``, whose ``__init__`` imports every model's config, two of which
      (InternVL, DeepSeek-OCR) import ``torchvision.transforms`` at module level. PyPI's torchvision
      is built against CUDA torch and cannot load next to the CPU build, and nothing on the
      memory path calls it; transformers has decided torchvision is missing before the stand-in
      exists, and the stand-in is removed from ``sys.modules`` afterwards."""
    if "sglang" not in sys.modules:
        package = types.ModuleType("sglang")
        package.__path__ = list(_found.submodule_search_locations or [])
        sys.modules["sglang"] = package
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached: False (a real torchvision is never used)
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    absent = {name: _Absent(name) for name in names if name not in sys.modules}
    sys.modules.update(absent)
    try:
        import sglang.srt.managers.schedule_batch  # noqa: F401
        import sglang.srt.managers.schedule_policy  # noqa: F401
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
    finally:
        for name in absent:
            sys.modules.pop(name, None)


_import_sglang()


def _publish_server_args() -> None:
    """SGLang's helpers read process-wide settings (``runtime_context``: the speculative
    algorithm, the scheduling policy, thinking-cache stripping, retraction backups) that a server
    publishes from its ``ServerArgs`` at start. Publish the defaults of a CPU server, whose model
    folder holds only a tiny ``config.json`` (nothing is loaded from it)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    from kvspec.conformance.adapters import tiny_model_folder

    if runtime_context.get_context().is_config_namespace_published("spec"):
        return
    folder = tiny_model_folder("sglang")
    args = ServerArgs(model_path=folder, device="cpu", skip_tokenizer_init=True)
    runtime_context.publish(args, role="scheduler")


_publish_server_args()

import torch  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.configs.model_config import (  # noqa: E402
    get_hybrid_layer_ids,
    is_hybrid_swa_model,
)
from sglang.srt.disaggregation.utils import prepare_abort  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import (  # noqa: E402
    AddReqResult,
    PrefillAdder,
    SchedulePolicy,
)
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (  # noqa: E402
    NewTokenRatioTracker,
)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import (  # noqa: E402
    checkpoint_kv_cache,
    release_kv_cache,
)
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode  # noqa: E402
from sglang.srt.mem_cache.registry import (  # noqa: E402
    TreeCacheBuildContext,
    create_tree_cache,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

__all__ = [
    "FINISH_ABORT",
    "AddReqResult",
    "NewTokenRatioTracker",
    "PrefillAdder",
    "RadixCache",
    "Req",
    "ScheduleBatch",
    "SchedulePolicy",
    "SpeculativeAlgorithm",
    "TreeNode",
    "UnifiedRadixCache",
    "get_hash_str",
    "hash_str_to_int64",
    "checkpoint_kv_cache",
    "envs",
    "prepare_abort",
    "release_kv_cache",
]

VOCAB = 4
"""Sampled tokens are 0 .. VOCAB - 1; token 0 is the stop token (``Config.stop_token``)."""
MAX_CONTEXT = 256
"""Columns of the req-to-token pool: longer than any fuzzed request (prompt + max tokens)."""
MODEL = types.SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False)
"""What ``ScheduleBatch`` reads from a ``ModelConfig``: the vocabulary (sampling buffers) and
whether the model has an encoder."""


TREES = ("unified", "python-core", "legacy", "swa")
"""The tree caches the adapter can build (``memory``): ``unified``, SGLang 0.5.23's default;
``python-core``, the same ``UnifiedRadixCache`` over SGLang's Python ``TreeCore`` instead of its
Rust one; ``legacy``, the ``RadixCache`` SGLang built before ``UnifiedRadixCache``; ``swa``, the
``UnifiedRadixCache`` (FULL and SWA components) SGLang builds for a hybrid sliding-window model
(``SWA_MODEL``). The fifth tree the adapter runs, ``mamba`` (FULL and MAMBA over a
``HybridReqToTokenPool``, for a hybrid linear-attention model), is ``mamba.mamba_memory``'s to
build: its model and pools are that module's, and it imports this one."""

SWA_MODEL = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 4,
    "hidden_size": 4,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "vocab_size": VOCAB,
}
"""The ``config.json`` of a tiny hybrid sliding-window model (gpt-oss's layout: sliding-window
layers beside full-attention ones), no weights: SGLang's ``ModelConfig`` reads from it whether the
model is hybrid SWA (``is_hybrid_swa_model``), which layers are which (``get_hybrid_layer_ids``)
and the window (``sliding_window``, in tokens)."""


def swa_layers(model: dict[str, Any] = SWA_MODEL) -> tuple[int, list[int], list[int]]:
    """What SGLang's ``ModelConfig._derive_hybrid_model`` reads off a hybrid SWA model's config:
    its window, its sliding-window layers and its full-attention layers (SGLang's own functions,
    on the config as Hugging Face loads it: an attribute per key)."""
    config = types.SimpleNamespace(**model)
    if not is_hybrid_swa_model(model["architectures"], config):
        raise RuntimeError(f"SGLang does not take {model['architectures']} for a hybrid SWA model")
    swa, full = get_hybrid_layer_ids(model["architectures"], config)
    return int(model["sliding_window"]), list(swa), list(full)


def swa_memory(page_size: int, pages: int, swa_pages: int, rows: int) -> tuple[Any, Any, Any]:
    """``memory`` for the hybrid SWA model ``SWA_MODEL``, as SGLang builds it (``kv_cache_configurator``:
    ``SWAKVPool`` over its full and sliding-window layers, ``SWATokenToKVPoolAllocator`` over
    ``pages`` full pages and ``swa_pages`` window pages, each pool's page 0 its padding slot;
    ``build_kv_cache``'s ``CacheInitParams`` with the model's ``sliding_window_size``; then
    ``create_tree_cache`` with ``is_hybrid_swa``): a ``UnifiedRadixCache`` with FULL and SWA."""
    window, swa_ids, full_ids = swa_layers()
    pool = ReqToTokenPool(
        size=rows, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
    )
    kv = SWAKVPool(
        size=pages * page_size,
        size_swa=swa_pages * page_size,
        page_size=page_size,
        dtype=torch.float32,
        head_num=1,
        head_dim=1,
        swa_attention_layer_ids=swa_ids,
        full_attention_layer_ids=full_ids,
        device="cpu",
    )
    allocator = SWATokenToKVPoolAllocator(
        pages * page_size,
        swa_pages * page_size,
        page_size,
        torch.float32,
        "cpu",
        kv,
        need_sort=False,
        req_to_token_pool=pool,
    )
    cache = _create(pool, allocator, page_size, "unified", window, pages * page_size)
    if set(cache.components) != {ComponentType.FULL, ComponentType.SWA}:
        raise RuntimeError(
            f"SGLang's create_tree_cache built {type(cache).__name__} with "
            f"{sorted(c.name for c in cache.components)}, not FULL and SWA"
        )
    return pool, allocator, cache


def memory(
    page_size: int, pages: int, rows: int, tree: str = "unified", swa_pages: int = 0
) -> tuple[Any, Any, Any]:
    """SGLang's ``ReqToTokenPool`` (``rows`` requests), ``PagedTokenToKVPoolAllocator`` over
    ``pages`` pages (its page 0 is the padding slot, so pages 1..pages are usable) and a tree cache
    over both (``TREES``), with its KV-event recorder on (for ``kv_stream.py``); for ``swa``,
    ``swa_memory`` with ``swa_pages`` window pages.

    The default tree is the one ``mem_cache/kv_cache_builder.py``'s ``build_kv_cache`` builds for a
    plain model (neither hybrid sliding-window nor SSM, no hierarchical cache, radix cache on):
    SGLang's own ``mem_cache/registry.py`` ``create_tree_cache`` on a ``TreeCacheBuildContext``,
    which takes ``default_radix_cache_factory`` and ``create_unified_radix_cache``: a
    ``UnifiedRadixCache`` with ``ComponentType.FULL`` alone, over the ``TreeCore`` SGLang selects
    (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, default ``rust``: the bundled extension). Nothing
    of that call needs a GPU: the model worker and model config are read only for hierarchical
    cache, LMCache and the external linker, all off. ``python-core`` is the same call with
    ``CacheInitParams.tree_core_backend="python"``; ``legacy`` builds ``RadixCache`` directly."""
    if tree not in TREES:
        raise ValueError(f"tree {tree!r}: one of {', '.join(TREES)}")
    if tree == "swa":
        return swa_memory(page_size, pages, swa_pages, rows)
    pool = ReqToTokenPool(
        size=rows, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
    )
    allocator = PagedTokenToKVPoolAllocator(
        pages * page_size, page_size, torch.float32, "cpu", None, need_sort=False
    )
    if tree == "legacy":
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            enable_kv_cache_events=True,
        )
        return pool, allocator, RadixCache(params)
    cache = _create(pool, allocator, page_size, tree, None, None)
    if not isinstance(cache, UnifiedRadixCache) or set(cache.components) != {ComponentType.FULL}:
        raise RuntimeError(
            f"SGLang's create_tree_cache built {type(cache).__name__}, not a UnifiedRadixCache "
            "with the FULL component alone: the adapter supports SGLang 0.5.23's default"
        )
    return pool, allocator, cache


def _create(
    pool: Any,
    allocator: Any,
    page_size: int,
    tree: str,
    window: int | None,
    full_tokens: int | None,
    ssm: bool = False,
    extra: bool = False,
) -> Any:
    """SGLang's ``create_tree_cache`` as ``build_kv_cache`` calls it on one CPU rank, no draft:
    a hybrid SWA model when ``window`` is given (``full_tokens``: its full pool's tokens), a
    hybrid SSM model with ``ssm`` (``pool`` then a ``HybridReqToTokenPool``; with ``extra`` its
    ping-pong track buffers, ``extra_buffer``: ``extra.py``)."""
    settings = runtime_context.get_memory()
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        eviction_policy=settings.radix_eviction_policy,
        eviction_policy_config=settings.radix_eviction_policy_config,
        enable_kv_cache_events=True,
        enable_session_radix_cache=settings.enable_session_radix_cache,
        chunked_prefill_size=None,
        sliding_window_size=window,
        tree_core_backend="python" if tree == "python-core" else None,
        enable_mamba_extra_buffer=extra,
    )
    context = TreeCacheBuildContext(
        server_args=None,  # read only where a hierarchical cache is attached
        params=params,
        is_hybrid_swa=window is not None,
        is_hybrid_ssm=ssm,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
        full_tokens_per_layer=full_tokens,
    )
    return create_tree_cache(context)


def core_backend(tree: Any) -> str:
    """The tree's kind as ``docs/adapters.md`` names it: ``legacy``, or the unified tree's
    ``TreeCore`` (``rust`` or ``python``)."""
    return getattr(tree, "_tree_core_backend", "legacy")


def new_request(rid: int, prompt: tuple[int, ...], max_new_tokens: int) -> Req:
    """SGLang's ``Req`` as ``TokenizerManager`` hands it to the scheduler: token ids, greedy
    sampling parameters with the stop token 0 (the fake model runner's), no logprobs."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=[0])
    params.normalize(None)
    return Req(str(rid), "", array("q", prompt), params, eos_token_ids={0}, vocab_size=VOCAB)


def empty_batch() -> ScheduleBatch:
    """``Scheduler.running_batch`` before anything runs."""
    return ScheduleBatch(reqs=[], batch_is_full=False)
