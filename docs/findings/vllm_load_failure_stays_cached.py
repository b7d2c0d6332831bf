"""vLLM 0.33.0 and 0.34.0: a synchronous KV load that failed stays in the prefix cache when its
request left before the failure was reported, and a later request hits the failed blocks.

Standalone (vLLM's own objects only; kvspec only for vLLM 0.34.0's CPU platform where it is
installed). Run it with vLLM 0.33.0's or 0.34.0's Python, e.g.
``.venv-vllm/bin/python docs/findings/vllm_load_failure_stays_cached.py``. Exit 1 when the bug
shows (a later request's prefix hit includes a block whose load failed), 0 when it does not, 2 on
a bad argument. The one optional argument: ``abort`` (the default) has the client cancel the
loading request before its step's output is processed; ``stay`` keeps it running, the case
vLLM handles, and exits 0 (the failed blocks are evicted).

What it plays: vLLM's defaults for what matters here: ``AsyncScheduler`` (async scheduling, so
the engine core's batch queue processes a step's output after the next call can have changed
the request), prefix caching, ``kv_load_failure_policy="fail"`` (vLLM's default), and vLLM's
``ExampleConnector`` as producer and consumer, scripted on the instance as vLLM's connector
tests do: its store holds two blocks of r0's prompt and the load is synchronous (it lands
before the step's forward pass). No worker runs; the runner's output is written here.

1. r0 (a 68-token prompt) is scheduled in step 0: two blocks are allocated for the external
   tokens and, the load being synchronous, registered in the prefix cache at once
   (``allocate_slots`` -> ``cache_blocks``), with the rest of the prompt's full blocks.
2. While step 0 is in flight the client aborts r0 (``finish_requests(..., FINISHED_ABORTED)``,
   what ``EngineCore.abort_requests`` calls between steps). vLLM keeps its blocks until step 0's
   output (``defer_block_free``: a KV consumer with a batch queue).
3. Step 0's output reports the load failed: ``invalid_block_ids`` names r0's first loaded block
   (``KVConnectorOutput``, as a worker's ``get_block_ids_with_load_errors`` does).
   ``update_from_output`` first returns r0's deferred blocks to the free queue, hashes kept,
   then ``_handle_invalid_blocks`` looks for the blocks' owners among ``running`` and the
   requests waiting for remote KV only: r0 is in neither, so nothing is evicted.
4. r1, with r0's prompt, is scheduled: its prefix-cache lookup hits the failed block and every
   block after it, and its step computes from K/V no one wrote.
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
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:  # vLLM 0.34.0 on an x86 CPU without triton-cpu (docs/adapters.md); nothing to do on a GPU
    from kvspec.conformance.adapters.vllm_adapter import cpu_platform

    cpu_platform.install()
except ImportError:  # no kvspec here: a GPU machine, or vLLM 0.33.0, needs none
    pass

BLOCK = 16
NUM_BLOCKS = 12  # block 0 is vLLM's null block
BUDGET = 128
PROMPT = [(7 * i + 3) % 200 + 1 for i in range(4 * BLOCK + 4)]
LOADED = 2 * BLOCK  # tokens r0's external store holds past its (empty) local hit
MODES = ("abort", "stay")


def model_folder() -> str:
    """A folder with only a tiny Llama ``config.json``: all ``ModelConfig`` reads."""
    folder = tempfile.mkdtemp(prefix="vllm-load-failure-model-")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def build() -> AsyncScheduler:
    model = ModelConfig(
        model=model_folder(), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=1024
    )
    scheduler_config = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        enable_chunked_prefill=True,
        async_scheduling=True,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_BLOCKS
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": tempfile.mkdtemp(prefix="vllm-store-")},
        kv_load_failure_policy="fail",
    )
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler_config,
        cache_config=cache,
        parallel_config=ParallelConfig(pipeline_parallel_size=1),
        kv_transfer_config=transfer,
    )
    # vLLM's CPU platform switches async scheduling off; a GPU keeps it (vLLM's default there;
    # the scheduler does not depend on the device).
    vllm_config.scheduler_config.async_scheduling = True
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    scheduler = AsyncScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )

    def matched(request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        # the store holds r0's first two blocks, loaded synchronously; nothing for r1
        if request.request_id != "r0" or num_computed_tokens:
            return 0, False
        return LOADED, False

    connector = scheduler.connector
    connector.get_num_new_matched_tokens = matched
    # its metadata would plan file reads for the worker; these steps run no worker
    connector.update_state_after_alloc = lambda request, blocks, num_external_tokens: None
    connector.build_connector_meta = lambda output: KVConnectorMetadata()
    return scheduler


def runner_output(req_ids: list[str], sampled: list[list[int]], **kw: object) -> ModelRunnerOutput:
    """The step's output: vLLM 0.33.0 indexes its rows by ``req_id_to_index``, 0.34.0 by the
    order of ``req_ids`` (it has no such field)."""
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    index = {r: i for i, r in enumerate(req_ids)}
    extra = {"req_id_to_index": index} if "req_id_to_index" in fields else {}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra, **kw)


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] not in MODES):
        print(f"usage: vllm_load_failure_stays_cached.py [{'|'.join(MODES)}]", file=sys.stderr)
        return 2
    mode = argv[0] if argv else "abort"
    scheduler = build()
    print(
        f"AsyncScheduler, ExampleConnector (kv_both), kv_load_failure_policy "
        f"{'fail' if not scheduler.recompute_kv_load_failures else 'recompute'}, "
        f"block size {BLOCK}, {NUM_BLOCKS - 1} usable blocks, defer_block_free "
        f"{scheduler.defer_block_free}; r0 leaves before step 0's output: {mode}"
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def arrive(rid: str, arrival: float) -> None:
        scheduler.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=list(PROMPT),
                sampling_params=SamplingParams(max_tokens=4),
                pooling_params=None,
                arrival_time=arrival,
                block_hasher=hasher,
            )
        )

    pool = scheduler.kv_cache_manager.block_pool
    arrive("r0", 0.0)
    step0 = scheduler.schedule()
    table = list(scheduler.kv_cache_manager.get_block_ids("r0")[0])
    loaded = table[: LOADED // BLOCK]
    cached = [b for b in table if pool.blocks[b].block_hash is not None]
    print(
        f"step 0 scheduled: {dict(step0.num_scheduled_tokens)}; r0's table {table}, "
        f"blocks {loaded} for the synchronous load of {LOADED} external tokens; "
        f"registered in the prefix cache: {cached}"
    )
    if mode == "abort":
        scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
        print("the client aborts r0 while step 0 is in flight")
    failed = {loaded[0]}
    ids = list(step0.num_scheduled_tokens)
    scheduler.update_from_output(
        step0,
        runner_output(
            ids,
            [[5] for _ in ids],
            kv_connector_output=KVConnectorOutput(invalid_block_ids=failed),
        ),
    )
    r0 = scheduler.requests.get("r0")
    print(
        f"step 0's output: the load of block {sorted(failed)} failed (invalid_block_ids); "
        f"r0 now {r0.status.name if r0 is not None else 'gone'}"
    )
    still = sorted(b for b in cached if pool.blocks[b].block_hash is not None)
    print(f"r0's blocks still registered after the output: {still}")

    arrive("r1", 1.0)
    step1 = scheduler.schedule()
    r1 = scheduler.requests["r1"]
    hit = list(scheduler.kv_cache_manager.get_block_ids("r1")[0])
    scheduled = step1.num_scheduled_tokens.get("r1", 0)
    hit_tokens = r1.num_computed_tokens - scheduled
    hit_blocks = hit[: hit_tokens // BLOCK]
    print(
        f"step 1 scheduled: {dict(step1.num_scheduled_tokens)}; r1 (r0's prompt) starts from "
        f"{hit_tokens} cached tokens, blocks {hit_blocks}"
    )
    bad = sorted(set(hit_blocks) & (failed | set(table[table.index(loaded[0]) :])))
    if bad:
        print(
            f"BUG: r1 hits block(s) {bad}: the failed load's block {sorted(failed)} and the "
            "blocks computed from it; nothing will write them again (exit 1)"
        )
        return 1
    print("r1 hits no block of the failed load (exit 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
