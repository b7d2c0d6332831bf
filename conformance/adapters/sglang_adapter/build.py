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
from sglang.srt.disaggregation.utils import prepare_abort  # noqa: E402
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
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import (  # noqa: E402
    checkpoint_kv_cache,
    release_kv_cache,
)
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode  # noqa: E402
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
    "checkpoint_kv_cache",
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


def memory(page_size: int, pages: int, rows: int) -> tuple[Any, Any, Any]:
    """SGLang's ``ReqToTokenPool`` (``rows`` requests), ``PagedTokenToKVPoolAllocator`` over
    ``pages`` pages (its page 0 is the padding slot, so pages 1..pages are usable) and
    ``RadixCache`` over both, as ``Scheduler.__init__`` builds them for a CPU worker."""
    pool = ReqToTokenPool(
        size=rows, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
    )
    allocator = PagedTokenToKVPoolAllocator(
        pages * page_size, page_size, torch.float32, "cpu", None, need_sort=False
    )
    tree = RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            enable_kv_cache_events=True,  # its KV events, for its publisher (kv_stream.py)
        )
    )
    return pool, allocator, tree


def new_request(rid: int, prompt: tuple[int, ...], max_new_tokens: int) -> Req:
    """SGLang's ``Req`` as ``TokenizerManager`` hands it to the scheduler: token ids, greedy
    sampling parameters with the stop token 0 (the fake model runner's), no logprobs."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=[0])
    params.normalize(None)
    return Req(str(rid), "", array("q", prompt), params, eos_token_ids={0}, vocab_size=VOCAB)


def empty_batch() -> ScheduleBatch:
    """``Scheduler.running_batch`` before anything runs."""
    return ScheduleBatch(reqs=[], batch_is_full=False)
