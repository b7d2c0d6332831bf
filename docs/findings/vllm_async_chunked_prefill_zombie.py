"""vLLM 0.33.0 and 0.34.0, async scheduling: a prefill chunk's blocks are published and never written.

Standalone (vLLM's own objects only; kvspec only for vLLM 0.34.0's CPU platform where it is
installed). Run it with vLLM 0.33.0's or 0.34.0's Python, e.g.
``.venv-vllm/bin/python docs/findings/vllm_async_chunked_prefill_zombie.py``. Exit 1 when the
bug shows (a later request hits a block whose K/V no step writes), 0 when it does not, 2 on a bad
argument. The one optional argument is ``long_prefill_token_threshold`` (default 32); with 0,
vLLM's default, the same arrivals do not show it (r0's second chunk takes the whole budget, so r1
is admitted only after r0's prompt is scheduled, and r0's later decodes run on placeholders).

What it plays: ``AsyncScheduler`` (Model Runner V2), prefix caching and chunked prefill on,
PRIORITY policy, a batch queue of two steps (``EngineCore.step_with_batch_queue``: step N+1 is
scheduled before step N's output is processed), ``long_prefill_token_threshold = 32``. The model
runner is a fake: it returns one sampled token per request whose chunk reaches its last token.

1. r0 (priority 1, a 144-token prompt: 9 of the 9 usable blocks, which admission checks it fits whole) prefills 64 tokens in step 0.
2. r1 (priority 0, 16 tokens) arrives; step 1 (step 0 still in flight) gives r0 its next chunk
   of 32 tokens (the threshold) and admits r1 behind it in ``running``.
3. Step 2 (step 1 still in flight): r0's next chunk, tokens 96..128, is allocated and its two
   full blocks are registered in the prefix cache at once (``allocate_slots`` ->
   ``cache_blocks``: the prompt's tokens are known). Then r1's decode needs a block, the pool
   is empty, and PRIORITY preempts the lowest-priority running request: r0, already scheduled
   in this call, so it is taken out of step 2 and its blocks are freed with their hashes.
4. No step ever writes r0's tokens 96..128. A request r2 with r0's first 128 tokens looks its
   prefix up and hits the first of those blocks (the second was evicted by r1's allocation).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM 0.33.0's default runner on a GPU

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
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


BLOCK = 16
NUM_BLOCKS = 10  # block 0 is vLLM's null block: 9 usable
BUDGET = 64


def model_folder() -> str:
    """A folder with only a tiny Llama ``config.json``: all ``ModelConfig`` reads."""
    folder = tempfile.mkdtemp(prefix="vllm-zombie-model-")
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


def build(threshold: int) -> AsyncScheduler:
    model = ModelConfig(
        model=model_folder(), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=1024
    )
    scheduler_config = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=threshold,
        policy="priority",
        async_scheduling=True,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler_config,
        cache_config=cache,
        parallel_config=ParallelConfig(pipeline_parallel_size=1),
    )
    # vLLM's CPU platform switches async scheduling off; a GPU keeps it (the scheduler does not
    # depend on the device).
    vllm_config.scheduler_config.async_scheduling = True
    assert vllm_config.max_concurrent_batches == 2  # a batch queue of two steps
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
    return AsyncScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


class Driver:
    """The engine core's batch queue over the scheduler, and a worker that records which
    blocks each step writes (a step writes the K/V of every position it computes)."""

    def __init__(self, threshold: int) -> None:
        self.scheduler = build(threshold)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.queue: list[tuple[int, object, dict[int, str]]] = []
        self.written: list[tuple[int, int]] = []  # (step, block id), in execution order
        self.step = 0

    def arrive(self, rid: str, prompt: list[int], priority: int, arrival: float) -> Request:
        request = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            arrival_time=arrival,
            priority=priority,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)
        return request

    def blocks_of(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def schedule(self) -> object:
        step = self.step
        self.step += 1
        output = self.scheduler.schedule()
        writes: dict[int, str] = {}
        for rid, n in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            table = self.blocks_of(rid)
            for pos in range(request.num_computed_tokens - n, request.num_computed_tokens):
                writes[table[pos // BLOCK]] = rid
        self.queue.append((step, output, writes))
        print(
            f"step {step} scheduled: {dict(output.num_scheduled_tokens)}, "
            f"preempted {sorted(output.preempted_req_ids)}"
        )
        return output

    def process_oldest(self) -> None:
        step, output, writes = self.queue.pop(0)
        self.written.extend((step, block) for block in writes)
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests.get(rid)
            samples = request is not None and not request.is_prefill_chunk
            sampled.append([7] if samples else [])
        runner = runner_output(req_ids, sampled)
        self.scheduler.update_from_output(output, runner)
        print(f"step {step} executed and processed (wrote blocks {sorted(writes)})")

    def published(self) -> dict[int, object]:
        return {b.block_id: b.block_hash for b in self.pool.blocks if b.block_hash is not None}


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and not argv[0].isdigit()):
        print(
            "usage: vllm_async_chunked_prefill_zombie.py [LONG_PREFILL_TOKEN_THRESHOLD]",
            file=sys.stderr,
        )
        return 2
    threshold = int(argv[0]) if argv else 32
    print(
        f"AsyncScheduler, PRIORITY, block size {BLOCK}, {NUM_BLOCKS - 1} usable blocks, "
        f"max_num_batched_tokens {BUDGET}, long_prefill_token_threshold {threshold}, "
        f"a batch queue of 2"
    )
    d = Driver(threshold)
    prompt0 = [(i * 7 + 3) % 250 + 1 for i in range(144)]
    d.arrive("r0", prompt0, priority=1, arrival=0.0)
    d.schedule()  # step 0: r0 tokens 0..64
    d.arrive("r1", [200 + i % 50 for i in range(16)], priority=0, arrival=1.0)
    d.schedule()  # step 1 (step 0 in flight): r0 64..96, r1 admitted (16 tokens)
    d.process_oldest()  # the batch queue is full: step 0's output
    table_before = d.blocks_of("r0")
    published_before = d.published()
    out2 = d.schedule()  # step 2 (step 1 in flight): r0 96..128, then r1's decode preempts r0
    new_published = {b: h for b, h in d.published().items() if b not in published_before}
    print(f"r0's table before step 2: {table_before}")
    print(
        f"blocks whose hash was published during step 2's schedule() and are still "
        f"published: {sorted(new_published)}"
    )
    in_step2 = "r0" in out2.num_scheduled_tokens
    print(
        f"r0 in step 2's output: {in_step2}; r0 preempted in step 2: "
        f"{'r0' in out2.preempted_req_ids}"
    )
    d.process_oldest()  # step 1's output
    d.process_oldest()  # step 2's output

    # A request with r0's first 128 tokens and a different tail looks its prefix up.
    prompt2 = prompt0[:128] + [251, 252, 253]
    r2 = d.arrive("r2", prompt2, priority=0, arrival=2.0)
    hit, num_hit = d.scheduler.kv_cache_manager.get_computed_blocks(r2)[:2]
    hit_ids = hit.get_block_ids()[0]
    written = {block for _, block in d.written}
    print(f"r2's prefix lookup: {num_hit} tokens cached, blocks {list(hit_ids)}")
    print(f"blocks written by every step executed so far: {sorted(written)}")
    zombies = [b for b in hit_ids if b not in written]
    if zombies:
        when = [
            "published in step 2's schedule()" if b in new_published else "published earlier"
            for b in zombies
        ]
        print(
            f"BUG: r2 hits block(s) {zombies} ({', '.join(when)}), whose K/V no executed "
            f"step wrote; r0 in step 2: {in_step2}, so its chunk 96..128 is never computed"
        )
        return 1
    print("no zombie hit: every block r2 hits was written by an executed step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
