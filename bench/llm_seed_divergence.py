"""What a user sees when the seed's bug strikes: SmolLM2 completions under ``eager-unsafe`` and
``deferred`` on the seed's scenario, next to Hugging Face's greedy completion.

The scenario (``tests/test_llm.py::seed_scenario`` on the tiny model; README, "the bug"): request
A (11 tokens, blocks of 4) is prefilled in two chunks; the second completes A's block 1, which
an eager policy publishes at once, and A is preempted in that same step (the general
discipline's preempt move, standing in for the seed's priority victim), so block 1 is never
written. A is aborted; C shares A's first 8 tokens, hits blocks 0 and 1, and reads two slots
that hold nothing (zeros: the KV cache starts zeroed). Its answer changes, plausibly.

    .venv/bin/python bench/llm_seed_divergence.py [--max-tokens 24]
"""

from __future__ import annotations

import argparse

import torch

from kvspec.impl.llm.llama import PagedLlama
from kvspec.impl.llm.model_worker import ModelWorker
from kvspec.impl.llm.weights import load_tokenizer, load_weights
from kvspec.impl.paged.kv_cache import KVCache
from kvspec.reference import Engine, EngineConfig


class Script:
    """Step 0: admit A, submit; step 1: run A, preempt it; then the default moves."""

    def __init__(self) -> None:
        self.answers = [0, 0, 0, 1]

    def pick(self, n: int, label: str) -> int:
        return self.answers.pop(0) if self.answers else 0


def run(weights, policy: str, a: list[int], c: list[int], max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    config = EngineConfig(
        num_blocks=64, block_size=4, policy=policy, discipline="general", token_budget=6
    )
    cfg = weights.config
    cache = KVCache.allocate(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim)
    for t in (*cache.k, *cache.v):
        t.zero_()
    engine = Engine(config, Script(), worker=ModelWorker(PagedLlama(weights, cache, "torch")))
    engine.add_request(1, tuple(a), 4)
    for _ in range(3):
        engine.step()
    assert ("preempt", 1) in engine.events, "the scenario did not play out"
    engine.abort(1)
    engine.add_request(3, tuple(c), max_tokens)
    engine.run()
    hits = [e for e in engine.events if e[0] == "hit" and e[1] == 3][0][2]
    print(f"  {policy}: C hit blocks {hits}")
    req = engine.requests[3]
    return req.tokens[req.prompt_len :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)
    weights = load_weights("smollm2")
    tok = load_tokenizer("smollm2")
    a = tok.encode("The Eiffel Tower is in Paris, the capital city of France.")[:11]
    c = a[:8] + tok.encode(" Its most famous museum is")
    print(f"A = {tok.decode(a)!r} ({len(a)} tokens)\nC = {tok.decode(c)!r}")
    from transformers import AutoModelForCausalLM

    from kvspec.impl.llm.weights import smollm2_path

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)  # fmt: skip
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([c])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                       do_sample=False, pad_token_id=0)[0, len(c):].tolist()  # fmt: skip
    outs = {p: run(weights, p, a, c, args.max_tokens) for p in ("eager-unsafe", "deferred")}
    print(f"\nHugging Face : {tok.decode(want)!r}")
    for policy, out in outs.items():
        verdict = "same as Hugging Face" if out == want else "DIFFERS from Hugging Face"
        print(f"{policy:13s}: {tok.decode(out)!r}  ({verdict})")


if __name__ == "__main__":
    main()
