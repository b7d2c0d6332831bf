"""vLLM hybrid KV-cache groups: the seed bug asked again for sliding-window and Mamba groups.

Standalone (vLLM's own objects only; no kvspec import). Run it with vLLM's Python, e.g.
``VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python docs/findings/vllm_hybrid_seed.py swa``.
One argument: ``swa`` (full attention + sliding window 32) or ``mamba`` (full attention + Mamba,
``mamba_cache_mode="align"``). Exit 1 when a later request's prefix hit contains a block (K/V or
Mamba state) that no executed step wrote, 0 when not, 2 on a bad argument.

The workload is the seed's mechanism as ``vllm_async_chunked_prefill_zombie.py`` plays it:
``AsyncScheduler`` with a batch queue of two steps, prefix caching, chunked prefill, the PRIORITY
policy, a 64-token budget and ``long_prefill_token_threshold``. r0 (priority 1, 144 tokens)
prefills in chunks; in step 2 its chunk's blocks are published in ``allocate_slots`` (every
group's manager ``cache_blocks``), then r1's decode cannot allocate and PRIORITY preempts r0, already
scheduled in the same call. r2 then looks up r0's first 128 tokens through
``HybridKVCacheCoordinator.find_longest_cache_hit``. The fake worker records what each executed
step writes: the K/V of every position it computes in the full and sliding-window groups, and in
the Mamba group the one state block at the step's end boundary (align mode).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM's default runner on a GPU

import torch  # noqa: E402
import vllm.triton_utils as triton_utils  # noqa: E402
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
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16
BUDGET = 64
WINDOW = 32
# Per model: (blocks in the shared pool, block 0 being the null block; the threshold). The pool
# is the smallest that admits r0's whole prompt and still leaves r1's step-2 decode short.
SETTINGS = {"swa": (20, 48), "mamba": (14, 32)}


def model_folder() -> str:
    """A folder with only a tiny Llama ``config.json``: all ``ModelConfig`` reads. The groups
    come from the ``KVCacheConfig`` below, as in vLLM's own hybrid scheduler tests."""
    folder = tempfile.mkdtemp(prefix="vllm-hybrid-model-")
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


def build(kind: str, num_blocks: int, threshold: int) -> AsyncScheduler:
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
    cache = CacheConfig(
        block_size=BLOCK,
        enable_prefix_caching=True,
        mamba_cache_mode="align" if kind == "mamba" else "none",
    )
    cache.num_gpu_blocks = num_blocks
    # vLLM 0.34.0's CPU platform hook raises "vLLM on x86 CPUs requires Triton" where 0.33.0
    # warned. The scheduler never runs Triton, so waive that one check for the length of the
    # VllmConfig call (the hook reads ``vllm.triton_utils.HAS_TRITON`` at call time); the rest of
    # the hook configures the CPU as vLLM does. On 0.33.0, or with Triton, this changes nothing.
    had_triton = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        vllm_config = VllmConfig(
            model_config=model,
            scheduler_config=scheduler_config,
            cache_config=cache,
            parallel_config=ParallelConfig(pipeline_parallel_size=1),
        )
    finally:
        triton_utils.HAS_TRITON = had_triton
    # vLLM's CPU platform switches async scheduling off; a GPU keeps it.
    vllm_config.scheduler_config.async_scheduling = True
    assert vllm_config.max_concurrent_batches == 2
    full = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if kind == "swa":
        other = SlidingWindowSpec(
            BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=WINDOW
        )
    else:
        other = MambaSpec(
            block_size=BLOCK, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
        )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["full"], full), KVCacheGroupSpec([kind], other)],
    )
    return AsyncScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


class Driver:
    """The engine core's batch queue over the scheduler, and a worker that records which blocks
    each executed step writes, per group."""

    def __init__(self, kind: str, num_blocks: int, threshold: int) -> None:
        self.kind = kind
        self.scheduler = build(kind, num_blocks, threshold)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.queue: list[tuple[int, object, set[int]]] = []
        self.written: set[int] = set()
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

    def tables(self, rid: str) -> list[list[int]]:
        return [list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(rid)]

    def schedule(self) -> object:
        step = self.step
        self.step += 1
        output = self.scheduler.schedule()
        writes: set[int] = set()
        for rid, n in output.num_scheduled_tokens.items():
            end = self.scheduler.requests[rid].num_computed_tokens
            full, other = self.tables(rid)
            writes.update(full[pos // BLOCK] for pos in range(end - n, end))
            if self.kind == "swa":
                writes.update(other[pos // BLOCK] for pos in range(end - n, end))
            else:
                writes.add(other[(end - 1) // BLOCK])  # the state after the step's last token
        writes.discard(self.pool.null_block.block_id)
        self.queue.append((step, output, writes))
        tables = {rid: self.tables(rid) for rid in output.num_scheduled_tokens}
        print(
            f"step {step} scheduled: {dict(output.num_scheduled_tokens)}, preempted "
            f"{sorted(output.preempted_req_ids)}, tables [full, {self.kind}]: {tables}"
        )
        return output

    def process_oldest(self) -> None:
        step, output, writes = self.queue.pop(0)
        self.written |= writes
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests.get(rid)
            sampled.append([7] if request is not None and not request.is_prefill_chunk else [])
        fields = {"req_ids": req_ids, "sampled_token_ids": sampled}
        if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # 0.33.0; gone in 0.34.0
            fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        runner = ModelRunnerOutput(**fields)
        self.scheduler.update_from_output(output, runner)
        print(f"step {step} executed and processed (wrote blocks {sorted(writes)})")

    def published(self) -> set[int]:
        return {b.block_id for b in self.pool.blocks if b.block_hash is not None}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in SETTINGS:
        print("usage: vllm_hybrid_seed.py swa|mamba", file=sys.stderr)
        return 2
    kind = argv[0]
    num_blocks, threshold = SETTINGS[kind]
    second = f"sliding window {WINDOW}" if kind == "swa" else "Mamba (align)"
    print(
        f"AsyncScheduler, PRIORITY, groups [full attention, {second}], block size {BLOCK}, "
        f"{num_blocks - 1} usable blocks (shared pool), max_num_batched_tokens {BUDGET}, "
        f"long_prefill_token_threshold {threshold}, a batch queue of 2"
    )
    d = Driver(kind, num_blocks, threshold)
    coordinator = d.scheduler.kv_cache_manager.coordinator
    managers = [type(m).__name__ for m in coordinator.single_type_managers]
    print(f"{type(coordinator).__name__} over {managers}")
    prompt0 = [(i * 7 + 3) % 250 + 1 for i in range(144)]
    d.arrive("r0", prompt0, priority=1, arrival=0.0)
    d.schedule()  # step 0: r0's first chunk
    d.arrive("r1", [200 + i % 50 for i in range(16)], priority=0, arrival=1.0)
    d.schedule()  # step 1 (step 0 in flight): r0's next chunk, r1 admitted behind it
    d.process_oldest()
    before = d.published()
    out2 = d.schedule()  # step 2: r0's chunk published, then r1's decode preempts r0
    unwritten = sorted(d.published() - before)
    print(f"published during step 2's schedule() and still published: {unwritten}")
    print(
        f"r0 in step 2's output: {'r0' in out2.num_scheduled_tokens}; "
        f"r0 preempted in step 2: {'r0' in out2.preempted_req_ids}"
    )
    while d.queue:
        d.process_oldest()
    stale = [b for b in unwritten if b not in d.written]
    print(f"of those, written by no executed step: {stale}")

    r2 = d.arrive("r2", prompt0[:128] + [251, 252, 253], priority=0, arrival=2.0)
    hit, num_hit = d.scheduler.kv_cache_manager.get_computed_blocks(r2)[:2]
    hit_ids = [list(g) for g in hit.get_block_ids()]
    null = d.pool.null_block.block_id
    print(f"r2's prefix lookup: {num_hit} tokens cached, blocks [full, {kind}] {hit_ids}")
    zombies = [b for g in hit_ids for b in g if b != null and b not in d.written]
    if zombies:
        print(
            f"BUG: r2 hits block(s) {zombies} that no executed step wrote (r0's step-2 chunk, "
            f"preempted out of the step that would have written them)"
        )
        return 1
    if stale:
        print(
            f"no zombie hit: blocks {stale} stay published unwritten, but the coordinator's "
            f"common hit stops at {num_hit} tokens, before them"
        )
    else:
        print("no zombie hit: every block r2 hits was written by an executed step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
