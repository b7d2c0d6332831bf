"""SGLang 0.5.23, MAMBA ``extra_buffer`` (non-lazy) under the overlap loop: the first decode
boundary after a prefill is never flipped, so the next boundary's in-flight step writes the track
slot that a request finishing meanwhile donates to the radix tree as its cached state.

Standalone: SGLang's own objects only, no kvspec import. Run it with SGLang 0.5.23's Python:
``.venv-sglang/bin/python docs/findings/sglang_extra_buffer_missed_flip.py [race|control]``.
Exit 1 when the race shows (the slot an in-flight step's ``mamba_track_indices`` names is a state
the tree holds as cached), 0 when it does not, 2 on a bad argument.

What it builds: the resolved server arguments of a tiny Qwen3-Next (``config.json`` only, no
weights; SGLang's ``auto`` resolves ``extra_buffer`` with the overlap loop on) with
``--mamba-track-interval 2`` and ``mamba_chunk_size`` 2, as SGLang's own ``RuntimeContext``; a
``HybridReqToTokenPool`` with ping-pong track buffers, a paged allocator (page 1) and
``create_tree_cache`` -> ``UnifiedRadixCache`` FULL+MAMBA; one ``Req`` (prompt ``[1]``, max 4
tokens, the model "samples" 1, 1, 0: 0 is the stop token); ``PrefillAdder`` +
``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode``; the decode result path is
SGLang's ``SchedulerBatchResultProcessor._handle_finish_state_updated_req`` (Mamba ping-pong
update, ``_mamba_prefix_cache_update``, then ``release_kv_cache(checkpoint=True)`` on a finish),
called on a small holder of the tree; the prefill result inserts with ``checkpoint_kv_cache``.
Steps go in the overlap order: batch N+1 is formed before batch N's result is processed.

Two things are answered for a CPU, each said where it is done: SGLang's argument resolution asks
whether the platform supports Mamba state snapshots (a CUDA server says yes; a CPU says no and
refuses ``extra_buffer``), and ``Tensor.pin_memory`` is the identity (PyTorch refuses to pin
without an accelerator; SGLang pins the decode's host track mask before copying it).

``control`` makes the flip SGLang misses (at the completed boundary's result, where
``mamba_next_track_idx == mamba_last_track_idx``, as the lazy mode's guard anticipates): no
in-flight step then names a cached slot, exit 0. ``race --prompt N`` takes an ``N``-token
prompt; with ``N`` even (interval 2) the first decode is not a boundary and the race does not
show either. ``--interval 256 --chunk 64 --prompt 255 --max-tokens 258`` is SGLang's default
interval and FLA chunk with a first decode at a boundary: the race shows (exit 1). Last, a later
request with r0's tokens is matched against the tree (``init_next_round_input``, as admission
does): it names the slot its Mamba state would be copied from.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import types
from array import array
from collections import deque

TRACK_INTERVAL = 2  # --mamba-track-interval (SGLang's default: 256)
QWEN3_NEXT = {  # a tiny Qwen3-Next: one gated-delta-net layer, one full-attention layer
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
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
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "mamba_chunk_size": 2,  # SGLang's mamba_cache_chunk_size reads it (the FLA kernel's: 64)
}


def import_sglang() -> None:
    """SGLang's scheduler modules without its package ``__init__`` (frontend, HTTP backends) and
    with ``torchvision`` absent during the import (two model configs import it; a CPU torch cannot
    load PyPI's torchvision, and nothing here uses it)."""
    found = importlib.util.find_spec("sglang")
    if found is None:
        sys.exit("run this with SGLang 0.5.23's Python (.venv-sglang/bin/python)")
    package = types.ModuleType("sglang")
    package.__path__ = list(found.submodule_search_locations or [])
    sys.modules["sglang"] = package
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    absent = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    for name in absent:
        module = types.ModuleType(name)
        module.__getattr__ = lambda attr: None  # type: ignore[method-assign]
        sys.modules[name] = module
    try:
        import sglang.srt.managers.schedule_batch  # noqa: F401
    finally:
        for name in absent:
            sys.modules.pop(name, None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="race", choices=("race", "control"))
    parser.add_argument("--prompt", type=int, default=1, help="prompt length (default 1)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--interval", type=int, default=TRACK_INTERVAL)
    parser.add_argument("--chunk", type=int, default=2, help="the model's mamba_chunk_size")
    args = parser.parse_args()
    if args.prompt < 1 or args.max_tokens < 2:
        print("--prompt must be at least 1 and --max-tokens at least 2", file=sys.stderr)
        return 2
    import_sglang()

    import torch
    from sglang.srt import runtime_context
    from sglang.srt.arg_groups import mamba_hook
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import checkpoint_kv_cache
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    folder = tempfile.mkdtemp(prefix="sglang-qwen3-next-")
    with open(f"{folder}/config.json", "w") as f:
        json.dump(dict(QWEN3_NEXT, mamba_chunk_size=args.chunk), f)
    server = ServerArgs(
        model_path=folder,
        device="cpu",
        skip_tokenizer_init=True,
        mamba_track_interval=args.interval,
    )
    asked = mamba_hook._platform_supports_mamba_cache_extra_buffer
    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True  # a CUDA server's answer
    try:
        context = runtime_context.create_context(server, role="scheduler")
    finally:
        mamba_hook._platform_supports_mamba_cache_extra_buffer = asked
    torch.Tensor.pin_memory = lambda self, *a, **kw: self  # type: ignore[method-assign]

    with runtime_context.use_context(context):
        mamba = runtime_context.get_exec().mamba
        overlap = not server.disable_overlap_schedule
        print(
            f"SGLang resolves: {mamba.mamba_radix_cache_strategy}, lazy "
            f"{mamba.enable_mamba_extra_buffer_lazy}, overlap {overlap}, track interval "
            f"{server.mamba_track_interval}, mamba_chunk_size {args.chunk}, page 1"
        )
        model_config = ModelConfig.from_server_args(server)
        cache = mambaish_config(model_config).mamba2_cache_params
        pool = HybridReqToTokenPool(
            size=2,
            mamba_size=10,
            mamba_spec_state_size=2,
            max_context_len=4096,
            device="cpu",
            enable_memory_saver=False,
            cache_params=cache,
            mamba_layer_ids=list(cache.layers),
            enable_mamba_extra_buffer=True,
            enable_overlap_schedule=overlap,
        )
        tokens = args.prompt + args.max_tokens + 8
        allocator = PagedTokenToKVPoolAllocator(
            tokens, 1, torch.float32, "cpu", None, need_sort=False
        )
        memory = runtime_context.get_memory()
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=allocator,
            page_size=1,
            eviction_policy=memory.radix_eviction_policy,
            eviction_policy_config=memory.radix_eviction_policy_config,
            enable_session_radix_cache=False,
            chunked_prefill_size=None,
            enable_mamba_extra_buffer=True,
        )
        tree = create_tree_cache(
            TreeCacheBuildContext(
                server_args=None,
                params=params,
                is_hybrid_swa=False,
                is_hybrid_ssm=True,
                enable_hierarchical_cache=False,
                disable_radix_cache=False,
                tp_worker=None,
                model_config=None,
                tp_size=1,
                tp_rank=0,
                tp_group=None,
            )
        )
        print(f"tree: {type(tree).__name__} {sorted(c.name for c in tree.components)}")
        batch_model = types.SimpleNamespace(
            vocab_size=256, is_encoder_decoder=False, hf_text_config=model_config.hf_text_config
        )

        class Results:
            """What ``_handle_finish_state_updated_req`` reads of the scheduler: the tree."""

            P = SchedulerBatchResultProcessor
            _handle_finish_state_updated_req = P._handle_finish_state_updated_req
            _mamba_prefix_cache_update = P._mamba_prefix_cache_update
            _mamba_check_track_boundary = P._mamba_check_track_boundary
            _mamba_assert_committed_len_lookahead = P.__dict__[
                "_mamba_assert_committed_len_lookahead"
            ]
            _mamba_can_cache_finished_req = P._mamba_can_cache_finished_req
            _prepare_kv_cache_release = P._prepare_kv_cache_release
            _maybe_collect_routed_experts = P._maybe_collect_routed_experts
            _maybe_collect_indexer_topk = P._maybe_collect_indexer_topk
            _maybe_collect_customized_info = P._maybe_collect_customized_info
            tree_cache, draft_worker, model_worker, req_to_token_pool = tree, None, None, pool

        results = Results()
        result = types.SimpleNamespace(num_correct_drafts_per_req_cpu=None)

        sampling = SamplingParams(max_new_tokens=args.max_tokens, stop_token_ids=[0])
        sampling.normalize(None)
        prompt = [1 + i % 200 for i in range(args.prompt)]
        req = Req("r0", "", array("q", prompt), sampling, eos_token_ids={0}, vocab_size=256)
        samples = deque([1] * (args.max_tokens - 2) + [0])  # stop one step before max

        def prefill() -> ScheduleBatch:
            running = ScheduleBatch(reqs=[], batch_is_full=False)
            adder = PrefillAdder(
                1,
                tree,
                allocator,
                running,
                0.7,
                8192,
                8192,
                0,
                0,
                max_prefill_bs=0,
                max_running_requests=2,
                waiting_queue_len=1,
            )
            req.init_next_round_input(tree)
            adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            batch = ScheduleBatch.init_new(
                [req],
                pool,
                allocator,
                tree,
                batch_model,
                overlap,
                SpeculativeAlgorithm.NONE,
            )
            batch.prepare_for_extend()
            batch.decoding_reqs = None
            return batch

        def cached_slots() -> set[int]:
            return {int(q) for q in tree.all_mamba_values_flatten().tolist()}

        in_flight: deque[tuple[int, ScheduleBatch]] = deque()
        found = False
        running = None
        for step in range(args.prompt + args.max_tokens + 2):
            # form batch N+1 (the overlap loop: before batch N's result)
            if running is None:
                batch = prefill()
                kind = "prefill"
            elif req.finished():
                batch = None
            else:
                running.filter_batch()
                batch = running
                batch.prepare_for_decode()
                kind = "decode"
            if batch is not None:
                verbose = step < 12 or step > args.max_tokens - 4
                tracks = batch.mamba_track_indices
                mask = (
                    batch.mamba_prefill_track_mask_cpu
                    if kind == "prefill"
                    else batch.mamba_track_mask_cpu
                )
                slot = int(tracks[0]) if tracks is not None and mask and mask[0] else None
                seq = int(batch.seq_lens_cpu[0])
                if verbose or slot is not None:
                    print(
                        f"step {step} formed: {kind}, seq_len {seq}, tracks into slot {slot} "
                        f"(ping-pong {req.kv.mamba_ping_pong_track_buffer.tolist()}, "
                        f"next {req.kv.mamba_next_track_idx}, last {req.kv.mamba_last_track_idx})"
                    )
                in_flight.append((step, batch.copy()))
                running = batch
            # process batch N's result
            if len(in_flight) > 1 or (batch is None and in_flight):
                done_step, done = in_flight.popleft()
                if req.finished():  # a finished request's later result is skipped
                    print(f"step {done_step} result: r0 finished before it, skipped")
                    continue
                token = samples.popleft()
                req.output_ids.append(token)
                req.update_finish_state()
                if done.forward_mode.is_extend():
                    if not req.finished():
                        checkpoint_kv_cache(
                            req, tree
                        )  # process_batch_result_prefill: a prefill that goes on
                else:
                    results._handle_finish_state_updated_req(req, done, result, 0, None)
                    if args.mode == "control" and control_flip(req, done, pool):
                        print(f"  control: flipped next to {req.kv.mamba_next_track_idx}")
                if verbose or req.finished():
                    print(
                        f"step {done_step} result: token {token}, finished {req.finished()}, "
                        f"tree's cached states {sorted(cached_slots())}"
                    )
                for flying_step, flying in in_flight:
                    mask = flying.mamba_track_mask_cpu
                    if flying.forward_mode.is_decode() and mask and mask[0]:
                        slot = int(flying.mamba_track_indices[0])
                        if slot in cached_slots():
                            found = True
                            print(
                                f"RACE: step {flying_step} (in flight, seq_len "
                                f"{int(flying.seq_lens_cpu[0])}) writes Mamba slot {slot}, which "
                                f"the tree holds as a cached state (all_mamba_values_flatten)"
                            )
            if batch is None and not in_flight:
                break
        # what a later request with r0's tokens would read: the tree's match, as admission does
        tokens = prompt + list(req.output_ids)
        later = Req("r1", "", array("q", tokens), sampling, eos_token_ids={0}, vocab_size=256)
        later.init_next_round_input(tree)
        source = later.kv.mamba_cow_src_index
        print(
            f"a later request with r0's {len(tokens)} tokens matches {later.prefix_len}; "
            f"its Mamba state is copied from slot "
            f"{None if source is None else int(source.reshape(-1)[0])}"
        )
        if not found:
            print("no in-flight step writes a slot the tree holds as cached")
        return 1 if found else 0


def control_flip(req, batch, pool) -> bool:  # type: ignore[no-untyped-def]  # noqa: ANN001
    """``control``: the flip SGLang misses, at the completed boundary's result."""
    kv = req.kv
    if (
        batch.mamba_track_mask_cpu is not None
        and batch.mamba_track_mask_cpu[0]
        and kv.mamba_ping_pong_track_buffer is not None
        and kv.mamba_next_track_idx == kv.mamba_last_track_idx
    ):
        kv.mamba_next_track_idx = pool.get_mamba_ping_pong_other_idx(kv.mamba_last_track_idx)
        return True
    return False


if __name__ == "__main__":
    sys.exit(main())
