"""vLLM 0.33.0 and 0.34.0: a Mamba ``align`` group's ``BlockStored`` carries more tokens than hashes.

Standalone: only vLLM's own objects (its ``Scheduler``, ``BlockPool`` and KV events); kvspec only
for vLLM 0.34.0's CPU platform, where it is installed. Run it in an environment with vLLM 0.33.0
or 0.34.0 (``.venv-vllm``, ``.venv-vllm-0.34.0``)::

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python docs/findings/vllm_mamba_block_stored_tokens.py

A scheduler over two KV-cache groups on one pool, built as vLLM's own hybrid scheduler tests
build it: full attention (group 0) beside a ``MambaSpec`` with ``mamba_cache_mode="align"``
(group 1), block size 2, prefix caching and KV events on. One request with an 8-token prompt:
vLLM schedules its first 6 tokens in one step. The full-attention group caches 3 blocks; the
Mamba group keeps only the state block at the step's end and puts the null block in the 2
positions before it. Its ``cache_full_blocks`` skips the null blocks when it lists hashes (and
extra keys), but takes ``token_ids`` over the whole range, null blocks included: one hash beside
3 blocks' tokens, and no offset saying which chunk the hash belongs to. A consumer that pairs
hashes with chunks by position (as it must for a dense store) files the hash of tokens 5..6
under tokens 1..2; the script prints that pairing beside the full-attention group's own store
of the same hash.

Prints every ``BlockStored`` the scheduler publishes; exits 1 when one has
``len(token_ids) != len(block_hashes) * block_size`` (the behaviour, present in both releases),
0 otherwise.
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
from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:  # vLLM 0.34.0 on an x86 CPU without triton-cpu (docs/adapters.md); nothing to do on a GPU
    from kvspec.conformance.adapters.vllm_adapter import cpu_platform

    cpu_platform.install()
except ImportError:  # no kvspec here: a GPU machine, or vLLM 0.33.0, needs none
    pass

BLOCK, BLOCKS, PROMPT = 2, 16, 8


def runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """The step's output: vLLM 0.33.0 indexes its rows by ``req_id_to_index``, 0.34.0 by the
    order of ``req_ids`` (it has no such field)."""
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    index = {r: i for i, r in enumerate(req_ids)}
    extra = {"req_id_to_index": index} if "req_id_to_index" in fields else {}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)


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
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, mamba_cache_mode="align")
    cache.num_gpu_blocks = BLOCKS
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    full = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(
        block_size=BLOCK, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    groups = [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["mamba"], mamba)]
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
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
    published: list[object] = []

    class Recorder:  # what the scheduler hands its publisher at the end of update_from_output
        def publish(self, batch: object) -> None:
            published.extend(batch.events)  # type: ignore[attr-defined]

        def shutdown(self) -> None:
            pass

    s.kv_event_publisher = Recorder()
    prompt = list(range(1, PROMPT + 1))
    print(f"full attention (group 0) + Mamba align (group 1), block size {BLOCK}; prompt {prompt}")
    s.add_request(Request("r0", prompt, SamplingParams(max_tokens=1), None, arrival_time=0.0, block_hasher=hasher))  # fmt: skip
    while s.has_requests():
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        if not ids:
            continue
        tables = [list(g) for g in s.kv_cache_manager.get_block_ids("r0")]
        print(f"scheduled {dict(out.num_scheduled_tokens)}, block tables [full, mamba] {tables}")
        prefilling = [r for r in ids if s.requests[r].num_computed_tokens < len(prompt)]
        s.update_from_output(out, runner_output(ids, [[] if r in prefilling else [7] for r in ids]))

    bad = 0
    chunk_of = {}  # hash -> its block's tokens, from the full-attention group's dense stores
    for e in published:
        if isinstance(e, BlockStored) and len(e.token_ids) == len(e.block_hashes) * e.block_size:
            for i, h in enumerate(e.block_hashes):
                chunk_of[h] = list(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
    for e in published:
        if not isinstance(e, BlockStored):
            continue
        hashes, tokens = e.block_hashes, e.token_ids
        group = getattr(e, "group_idx", None)
        said = f"BlockStored group {group}: {len(hashes)} hashes {[show(h) for h in hashes]}, block size {e.block_size}, token_ids {tokens}"  # fmt: skip
        if len(tokens) != len(hashes) * e.block_size:
            bad += 1
            said += f"   <- {len(tokens)} tokens for {len(hashes)} hashes of {e.block_size}"
            for i, h in enumerate(
                hashes
            ):  # what a consumer pairing hashes with chunks by position reads
                guess = list(tokens[i * e.block_size : (i + 1) * e.block_size])
                said += f"\n    by position {show(h)} holds {guess}; group 0 stored {show(h)} for {chunk_of.get(h)}"  # fmt: skip
        print(said)
    print(f"BlockStored events whose tokens do not match their hashes: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
