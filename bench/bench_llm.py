"""Benchmark of the reference LLM engine (``kvspec.LLM``) on a shared-system-prompt workload.

N requests share a P-token prefix (random token ids, seeded), each followed by its own S-token
suffix, and generate M tokens greedily (EOS ignored). Measured side by side in one run, on the
same weights, threads and attention backend:

1. ``kvspec.LLM`` with prefix caching (the cache reset before each run, so the first request
   computes the prefix): wall time, generated tokens/s, prefix hit rate, prefill tokens saved;
2. the same without prefix caching (``EngineConfig.prefix_caching=False``);
3. Hugging Face ``generate`` one request at a time (its own dense KV cache, no batching), the
   baseline, whose tokens are also compared with the engine's.

The ideal speedup that the hit rate allows: prefix caching can only remove the prefill work
of the tokens it hits. With ``h`` the fraction of the no-caching run's prefill tokens saved and
``T_prefill`` the time that run spent in steps holding prefill tokens (the rest: steps of
decodes only), two ideals are printed:

* Amdahl on the no-caching run: ``T_without / (T_without - h * T_prefill)``. It assumes the
  decode-only time stays the same, but it does not: without caching, running requests' decodes
  ride along in the long prefill steps of the others (a few rows more in a 512-row step, nearly
  free); with caching there are hardly any prefill steps, and the same decodes need steps of
  their own (each reads every weight for 8 tokens). So this ideal is too high.
* The ideal given the decode-only steps the caching run needed (``T_decode_with``):
  ``T_without / ((1 - h) * T_prefill + T_decode_with)``: prefill at exactly (1 - h) of its cost.
  The target (achieved / ideal >= 0.8) is judged on this one.

The achieved speedup is the ratio of the wall times. Also printed: the ratio of computed tokens
(which prices a decode token like a prefill token). Times and their parts are medians over
``--repeats``, the runs with and without caching interleaved.

    .venv/bin/python bench/bench_llm.py [--model smollm2] [--requests 32] [--prefix 512]
        [--suffix 16] [--max-tokens 16] [--threads 1] [--repeats 1] [--hf-repeats 1]
        [--backend torch] [--no-hf]

``--threads 1`` by default: on a machine whose cores are shared with other jobs, torch's
OpenMP threads spin against each other (10x slower per step measured here with 2 threads).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvspec.impl.llm.engine import LLM
from kvspec.impl.llm.sampling import SamplingParams
from kvspec.impl.llm.weights import load_weights, resolve_model


def workload(n: int, prefix: int, suffix: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1000, vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(1000, vocab) for _ in range(suffix)] for _ in range(n)]


def run_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, dict]:
    llm.engine.reset_prefix_cache()
    before = dict(llm.stats)
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    after = llm.stats
    delta = {k: after[k] - before.get(k, 0) for k in after}
    delta["outputs"] = [o.token_ids for o in outs]  # type: ignore[assignment]
    return seconds, delta


def run_hf(model, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    outs = []
    started = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        seq = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(seq[0, len(prompt) :].tolist())
    return time.perf_counter() - started, outs


def hf_model(model: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    path = resolve_model(model)
    if path.is_file():
        m = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    m.eval()
    m.generation_config.eos_token_id = None  # EOS ignored, as in the engine runs
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--backend", default="torch", choices=("torch", "triton"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--hf-repeats", type=int, default=1, help="runs of the (slow) baseline")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    weights = load_weights(args.model)
    print(
        f"model {args.model}: {weights.config.num_layers} layers, "
        f"{weights.num_parameters / 1e6:.1f}M parameters, loaded in "
        f"{time.perf_counter() - started:.1f} s; attention {args.backend}; "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    prompts = workload(
        args.requests, args.prefix, args.suffix, weights.config.vocab_size, args.seed
    )
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    seq = args.prefix + args.suffix + args.max_tokens
    common = dict(
        backend=args.backend,
        block_size=args.block_size,
        kv_tokens=args.max_running * seq + args.prefix + 4 * args.block_size,
        token_budget=args.token_budget,
        max_running=args.max_running,
        tokenizer=False,
    )
    print(
        f"workload: {args.requests} requests, a shared {args.prefix}-token prefix + "
        f"{args.suffix}-token suffix each, {args.max_tokens} tokens generated each; "
        f"block {args.block_size}, token budget {args.token_budget}, max running "
        f"{args.max_running}, policy deferred, depth 1"
    )
    names = {True: "prefix caching", False: "no prefix caching"}
    engines = {}
    for caching in names:
        engines[caching] = LLM(weights, prefix_caching=caching, **common)  # type: ignore[arg-type]
        engines[caching].generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm up
    times: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    last: dict[bool, dict] = {}
    for _ in range(args.repeats):  # interleaved, so that a slow spell of the machine hits both
        for caching, llm in engines.items():
            seconds, last[caching] = run_engine(llm, prompts, params)
            decode_s = last[caching]["model_decode_seconds"]
            prefill_s = last[caching]["model_seconds"] - decode_s
            times[caching].append((seconds, prefill_s, decode_s))
    runs = {}
    for c in names:  # medians of the wall time and of each part
        stats = dict(last[c])
        stats["prefill_s"] = statistics.median(t[1] for t in times[c])
        stats["decode_s"] = statistics.median(t[2] for t in times[c])
        runs[names[c]] = (statistics.median(t[0] for t in times[c]), stats)
    generated = args.requests * args.max_tokens
    prompt_tokens = args.requests * (args.prefix + args.suffix)
    print(
        f"\n{'run':20s} {'seconds':>8s} {'gen tok/s':>10s} {'computed tok':>13s} "
        f"{'hit rate':>9s} {'prefill steps s':>16s} {'decode steps s':>15s}"
    )
    for name, (seconds, stats) in runs.items():
        hits = stats["hit_tokens"]
        print(
            f"{name:20s} {seconds:8.1f} {generated / seconds:10.1f} "
            f"{stats['computed_tokens']:13d} {hits / prompt_tokens:9.1%} "
            f"{stats['prefill_s']:16.1f} {stats['decode_s']:15.1f}"
        )
    with_s, with_stats = runs["prefix caching"]
    without_s, without_stats = runs["no prefix caching"]
    if with_stats["outputs"] != without_stats["outputs"]:
        raise SystemExit("the outputs with and without prefix caching differ")
    saved = without_stats["computed_tokens"] - with_stats["computed_tokens"]
    token_ratio = without_stats["computed_tokens"] / with_stats["computed_tokens"]
    decode_tokens = args.requests * (args.max_tokens - 1)
    h = saved / (without_stats["computed_tokens"] - decode_tokens)
    prefill_s = without_stats["prefill_s"]
    ideal = without_s / (without_s - h * prefill_s)
    achieved = without_s / with_s
    # Without caching, decodes ride along in the long prefill steps; with it, they need steps of
    # their own, which caching cannot shorten: the ideal given the decode-only steps it had.
    ideal_own = without_s / ((1 - h) * prefill_s + with_stats["decode_s"])
    print(
        f"\nprefill tokens saved: {saved} of {prompt_tokens} prompt tokens "
        f"(hit rate {with_stats['hit_tokens'] / prompt_tokens:.1%}, "
        f"{with_stats['preemptions']} preemptions); without caching {prefill_s:.1f} s of "
        f"{without_s:.1f} s were prefill steps"
    )
    print(
        f"speedup from prefix caching: achieved {achieved:.2f}x, ideal {ideal:.2f}x "
        f"(Amdahl: {h:.1%} of the prefill work saved); achieved / ideal = "
        f"{achieved / ideal:.2f}; computed tokens without / with: {token_ratio:.2f}x"
    )
    print(
        f"ideal given the decode-only steps of the caching run ({with_stats['decode_s']:.1f} s): "
        f"{ideal_own:.2f}x; achieved / ideal = {achieved / ideal_own:.2f} (target >= 0.8)"
    )
    if not args.no_hf:
        model = hf_model(args.model)
        torch.set_num_threads(args.threads)
        hf_times, outs = [], []
        for _ in range(args.hf_repeats):
            seconds, outs = run_hf(model, prompts, args.max_tokens)
            hf_times.append(seconds)
        hf_s = statistics.median(hf_times)
        same = sum(a == b for a, b in zip(outs, with_stats["outputs"], strict=True))
        print(
            f"Hugging Face generate, one request at a time: {hf_s:.1f} s, "
            f"{generated / hf_s:.1f} gen tok/s; kvspec with prefix caching is "
            f"{hf_s / with_s:.2f}x faster, without {hf_s / without_s:.2f}x; "
            f"{same}/{len(outs)} requests give the same tokens"
        )


if __name__ == "__main__":
    main()
