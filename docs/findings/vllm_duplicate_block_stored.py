"""vLLM 0.33.0 and 0.34.0: one hash stored twice on the KV-event stream, then removed while still cached.

Standalone: only vLLM's own objects (its ``Scheduler``, ``KVCacheManager``, ``BlockPool`` and KV
events); kvspec only for vLLM 0.34.0's CPU platform, where it is installed. Run it in an environment with vLLM 0.33.0 or 0.34.0 (``.venv-vllm``, ``.venv-vllm-0.34.0``)::

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python docs/findings/vllm_duplicate_block_stored.py

Two requests with the same block-aligned prompt of 2 blocks (block size 2). The first computes
and caches both blocks (hashes H0, H1). The second hits only H0: vLLM's lookup stops one token
short of the prompt so that the last token is recomputed for its logits, so it recomputes block 1
into a new physical block and caches it under H1 again. vLLM does not deduplicate equal blocks
(``BlockHashToBlockMap``'s NOTE #1), so the stream says ``BlockStored(H1)`` twice. When one of
the two physical blocks is evicted, the stream says ``BlockRemoved(H1)`` once, while the other
block still holds H1 and vLLM still hits it. A router that keeps a *set* of hashes drops H1 there
and under-credits this engine for every prefix through H1; one that counts stores and removals
(kvspec's reference index, Dynamo's ``EventDedupFilter``, llm-d's ``eventDedupFilter``) does not.

Prints the events of each published batch, then the two checks; exits 1 when the behaviour is
seen (as it is in 0.33.0), 0 otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:  # vLLM 0.34.0 on an x86 CPU without triton-cpu (docs/adapters.md); nothing to do on a GPU
    from kvspec.conformance.adapters.vllm_adapter import cpu_platform

    cpu_platform.install()
except ImportError:  # no kvspec here: a GPU machine, or vLLM 0.33.0, needs none
    pass


def runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """The step's output: vLLM 0.33.0 indexes its rows by ``req_id_to_index``, 0.34.0 by the
    order of ``req_ids`` (it has no such field)."""
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    index = {r: i for i, r in enumerate(req_ids)}
    extra = {"req_id_to_index": index} if "req_id_to_index" in fields else {}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)


BLOCK, BLOCKS = 2, 6


def show(h: object) -> str:
    """vLLM publishes 64-bit ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), else bytes."""
    return h.hex()[:8] if isinstance(h, bytes) else f"{h:#018x}"[:10]  # type: ignore[str-format]


def scheduler() -> Scheduler:
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 4096, "torch_dtype": "float32"}, f)  # fmt: skip
    model = ModelConfig(
        model=folder, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=64
    )
    sched = SchedulerConfig(max_model_len=64, is_encoder_decoder=False, max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=True)  # fmt: skip
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = BLOCKS
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])  # fmt: skip
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def main() -> int:
    s = scheduler()
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    published: list[list[object]] = []

    class Recorder:  # what the scheduler hands its publisher at the end of update_from_output
        def publish(self, batch: object) -> None:
            published.append(list(batch.events))  # type: ignore[attr-defined]

        def shutdown(self) -> None:
            pass

    s.kv_event_publisher = Recorder()

    pool = s.kv_cache_manager.block_pool
    set_view: set[object] = set()  # what a router that keeps a set of hashes holds
    seen: list[str] = []

    def boundary() -> None:
        """After update_from_output (vLLM's step boundary): the batch it published, then the
        set-based view against vLLM's prefix cache."""
        for e in published[-1] if published and len(published) > len(seen) else []:
            if isinstance(e, BlockStored):
                twice = [h for h in e.block_hashes if h in set_view]
                set_view.update(e.block_hashes)
                said = f"  BlockStored {[show(h) for h in e.block_hashes]} parent {show(e.parent_block_hash) if e.parent_block_hash is not None else None}"  # fmt: skip
                print(said + (f"   <- {[show(h) for h in twice]} stored again" if twice else ""))
            elif isinstance(e, BlockRemoved):
                set_view.difference_update(e.block_hashes)
                print(f"  BlockRemoved {[show(h) for h in e.block_hashes]}")
        if len(published) > len(seen):
            seen.append("")
        cached = {maybe_convert_block_hash(get_block_hash(k)) for k in pool.cached_block_hash_to_block._cache}  # fmt: skip
        missing = cached - set_view
        if missing:
            found.extend(missing)
            print(
                f"  vLLM still caches {[show(h) for h in missing]}, which a set-based router dropped"
            )

    found: list[object] = []

    def run(rid: str, prompt: list[int]) -> None:
        print(f"request {rid}: prompt {prompt}")
        params = SamplingParams(max_tokens=1)
        s.add_request(Request(rid, prompt, params, None, arrival_time=float(len(published)), block_hasher=hasher))  # fmt: skip
        while s.has_requests():
            out = s.schedule()
            ids = list(out.num_scheduled_tokens)
            runner = runner_output(ids, [[7] for _ in ids])
            s.update_from_output(out, runner)
            boundary()

    run("a", [1, 2, 3, 4])  # caches H0, H1
    run("b", [1, 2, 3, 4])  # hits H0, recomputes block 1: H1 again, in another block
    run("c", [5, 6, 5, 6, 5])  # evicts blocks from the free queue's head: one copy of H1 first
    print(f"a set-based router lost hashes vLLM still hits: {sorted({show(h) for h in found})}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
