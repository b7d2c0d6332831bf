"""The reference LLM engine on a tiny random Llama: every request's tokens equal Hugging Face's
dense greedy generation and its logits agree within 1e-4 (float32), while the workload forces
preemptions (a small pool), aborts, shared prefixes and chunked prefill (a small token budget),
at depths 1 to 3 under several policies, with and without async scheduling (decodes scheduled
on placeholder tokens, stale output dropped or delivered); the seed's zombie read under ``eager-unsafe`` changes
the tokens a user gets. Attention runs on the Triton kernels (interpreted on a CPU)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from llm_helpers import HFOracle, model_engine, save_tiny_llama  # noqa: E402

from kvspec.cli import main  # noqa: E402
from kvspec.impl.llm.engine import LLM  # noqa: E402
from kvspec.impl.llm.sampling import SamplingParams  # noqa: E402
from kvspec.impl.llm.weights import load_weights, unpermute_rope_rows  # noqa: E402
from kvspec.impl.paged.attention_ref import paged_attention_ref  # noqa: E402
from kvspec.impl.paged.attention_torch import paged_attention_torch  # noqa: E402
from kvspec.impl.paged.batch import make_batch  # noqa: E402
from kvspec.reference import EngineConfig, RandomChoices  # noqa: E402

MAX_NEW = 6
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny_llama(folder)
    return folder, load_weights(folder), HFOracle(hf, MAX_NEW)


def check_against_hf(oracle: HFOracle, prompt: tuple[int, ...], tokens, logits) -> None:  # type: ignore[no-untyped-def]
    want, want_logits = oracle(prompt)
    assert tokens == want[: len(tokens)], (prompt, tokens, want)
    got = torch.stack(logits) if logits else torch.empty(0, want_logits.shape[1])
    assert got.shape[0] == len(tokens)
    if tokens:
        error = (got - want_logits[: len(tokens)]).abs().max().item()
        assert error <= TOL, (prompt, error)


STRESS = [
    # policy, discipline, preemption, depth, async scheduling with stale output (None: sync)
    ("deferred", "vllm", "fcfs", 1, None),
    ("deferred", "general", "priority", 2, None),
    ("hide-uncommitted", "general", "fcfs", 3, None),
    ("eager-rollback-fifo", "vllm", "priority", 3, None),
    ("deferred", "vllm", "fcfs", 2, "deliver"),  # vLLM's defaults
]


@pytest.mark.parametrize("policy, discipline, preemption, depth, stale", STRESS)
def test_tokens_and_logits_equal_hf_under_stress(
    tiny, policy, discipline, preemption, depth, stale
) -> None:  # type: ignore[no-untyped-def]
    _, weights, oracle = tiny
    rng = random.Random(f"{policy}-{discipline}-{depth}" + (f"-async-{stale}" if stale else ""))
    config = EngineConfig(
        num_blocks=9,  # 8 blocks of 4 tokens for up to 3 running requests of up to 20 tokens
        block_size=4,
        depth=depth,
        policy=policy,
        discipline=discipline,
        preemption=preemption,
        token_budget=7,  # prompts of 9 to 14 tokens are prefilled in chunks
        max_running=3,
        async_scheduling=stale is not None,
        stale_output=stale or "drop",
    )
    engine, worker = model_engine(weights, config, "triton", RandomChoices(rng.randrange(1 << 30)))
    prefixes = [tuple(rng.randrange(101) for _ in range(n)) for n in (8, 9)]
    prompts = {}
    for rid in range(9):
        prompt = rng.choice(prefixes) + tuple(rng.randrange(101) for _ in range(rng.randint(1, 5)))
        prompts[rid] = prompt
    added = 0
    aborted = set()
    for _ in range(2000):
        if added < len(prompts) and (added < 3 or rng.random() < 0.3):
            engine.add_request(added, prompts[added], rng.randint(3, MAX_NEW), rng.randrange(3))
            added += 1
        if added > 3 and rng.random() < 0.04:
            rid = rng.randrange(added)
            if engine.abort(rid):
                aborted.add(rid)
        if not engine.step() and added == len(prompts):
            break
    stats = engine.stats
    assert not engine.has_unfinished()
    assert stats["preemptions"] > 0 and stats["hit_tokens"] > 0 and aborted
    assert (stats["placeholder_tokens"] > 0) == (stale is not None)  # async really overlapped
    assert (stats["stale_delivered"] > 0) == (stale == "deliver")
    assert stats["computed_tokens"] > stats["prompt_tokens"] - stats["hit_tokens"]  # recomputation
    for rid, req in engine.requests.items():
        out = req.tokens[req.prompt_len :]
        if rid not in aborted:
            assert len(out) == req.max_tokens
        check_against_hf(oracle, prompts[rid], out, worker.recorded.get(rid, []))


class Script:
    """Choices that answer a fixed list, then 0 (the default move)."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = list(answers)

    def pick(self, n: int, label: str) -> int:
        return self.answers.pop(0) if self.answers else 0


A = tuple(range(1, 12))
C = A[:8] + (3,)


def seed_scenario(weights, policy: str):  # type: ignore[no-untyped-def]
    """The seed's bug on the engine: A is scheduled for the chunk that completes its block 1
    (eager policies publish it at once) and preempted in that same step, so block 1 is never
    written; A is then aborted, and C, sharing A's first 8 tokens, hits block 1 and reads it."""
    config = EngineConfig(
        num_blocks=6, block_size=4, policy=policy, discipline="general", token_budget=6
    )
    # step 0: admit A (6 tokens), submit; step 1: run A (5 tokens), preempt it, submit
    engine, worker = model_engine(weights, config, "triton", Script([0, 0, 0, 1]), record=True)
    engine.add_request(1, A, 4)
    engine.step()
    engine.step()
    engine.step()
    assert ("preempt", 1) in engine.events
    engine.abort(1)
    engine.add_request(3, C, MAX_NEW)
    engine.run()
    hits = [e for e in engine.events if e[0] == "hit" and e[1] == 3]
    req = engine.requests[3]
    return req.tokens[req.prompt_len :], worker.recorded[3], hits


def test_seed_zombie_read_changes_the_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    _, weights, oracle = tiny
    want, want_logits = oracle(C)
    tokens, logits, hits = seed_scenario(weights, "eager-unsafe")
    assert len(hits[0][2]) == 2  # C hit A's blocks 0 and 1; block 1 holds 2 unwritten slots
    assert tokens != want
    assert (torch.stack(logits) - want_logits).abs().max().item() > 0.1
    safe_tokens, safe_logits, safe_hits = seed_scenario(weights, "deferred")
    assert len(safe_hits[0][2]) == 1  # only block 0, written, was published
    check_against_hf(oracle, C, safe_tokens, safe_logits)


def test_llm_generate_greedy_stop_and_seeded(tiny) -> None:  # type: ignore[no-untyped-def]
    folder, _, oracle = tiny
    prompts = [list(A), list(C), [7, 8, 9]]
    llm = LLM(folder, tokenizer=False, backend="triton", block_size=4, num_blocks=16,
              token_budget=8, record_logits=True, depth=2)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length"
        check_against_hf(oracle, tuple(prompt), out.token_ids, llm.worker.recorded[out.request_id])
    # a stop token ends the request where Hugging Face's greedy output has it (kept)
    want = oracle(tuple(prompts[0]))[0]
    stop = want[2]
    (out,) = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(stop,)))
    assert out.finish_reason == "stop" and out.token_ids == want[: want.index(stop) + 1]
    # async scheduling (vLLM's default): decodes on placeholder tokens give the same greedy
    # tokens, and a stop token still ends where Hugging Face has it (the abort that ends it
    # discards the output of the later step that already holds the request)
    overlapped = LLM(folder, tokenizer=False, backend="torch", block_size=4, num_blocks=16,
                     token_budget=8, record_logits=True, depth=2, async_scheduling=True)  # fmt: skip
    for prompt, out in zip(
        prompts, overlapped.generate(prompts, SamplingParams(max_tokens=MAX_NEW)), strict=True
    ):
        check_against_hf(
            oracle, tuple(prompt), out.token_ids, overlapped.worker.recorded[out.request_id]
        )
    (out,) = overlapped.generate(
        [prompts[0]], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(stop,))
    )
    assert out.finish_reason == "stop" and out.token_ids == want[: want.index(stop) + 1]
    assert overlapped.stats["placeholder_tokens"] > 0
    # seeded sampling: the same seed gives the same tokens whatever else runs, and in any engine
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    alone = llm.generate([prompts[2]], sampled)[0].token_ids
    crowd = llm.generate(prompts, [SamplingParams(max_tokens=3), SamplingParams(), sampled])
    other = LLM(folder, tokenizer=False, backend="torch", block_size=8, num_blocks=8)
    assert crowd[2].token_ids == alone == other.generate([prompts[2]], sampled)[0].token_ids
    reseeded = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_k=20, top_p=0.9, seed=8)
    assert other.generate([prompts[2]], reseeded)[0].token_ids != alone


def test_bad_inputs_are_clear_errors(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, _, _ = tiny
    with pytest.raises(ValueError, match="not a model folder"):
        LLM(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json:1"):
        LLM(tmp_path)
    with pytest.raises(ValueError, match="backend"):
        LLM(folder, tokenizer=False, backend="cuda-magic")
    llm = LLM(folder, tokenizer=False, backend="torch", num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="outside"):
        llm.generate([[1000]])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text"])
    with pytest.raises(ValueError, match="prompt 1: .* blocks"):
        llm.generate([[1, 2], list(range(20))], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()  # the first prompt was withdrawn too
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--model", "/nowhere", "--prompt", "x"], "not a model folder"),
        (["--model", "smollm2", "--prompt", "x", "--max-tokens", "0"], "must be > 0"),
        (["--model", "smollm2", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--model", "smollm2", "--prompt", "x", "--policy", "nope"], "invalid choice"),
        (["--model", "smollm2"], "--prompt"),
    ],
)
def test_cli_generate_bad_arguments(argv, fragment, capsys) -> None:  # type: ignore[no-untyped-def]
    try:
        code = main(["generate", *argv])
    except SystemExit as exit:
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and fragment in err, err


def test_cli_generate_needs_a_tokenizer(tiny, capsys) -> None:  # type: ignore[no-untyped-def]
    folder, _, _ = tiny  # saved without tokenizer files
    assert main(["generate", "--model", str(folder), "--prompt", "x", "--backend", "torch"]) == 2
    assert "no usable tokenizer" in capsys.readouterr().err


def test_torch_backend_matches_the_oracle() -> None:
    """The batched torch paged attention equals ``paged_attention_ref`` on a mixed batch (a
    decode, a chunk over a cached context, a whole prefill), with NaN in every unused slot."""
    gen = torch.Generator().manual_seed(0)
    bsz, kv_heads, head_dim, heads = 4, 2, 16, 6
    k_cache = torch.randn(12, bsz, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(12, bsz, kv_heads, head_dim, generator=gen)
    query_lens, seq_lens = [1, 5, 7, 1, 8], [10, 9, 7, 3, 8]  # chunks of 5, 7, 8: one group
    tables = [[3, 1, 7], [2, 5, 9], [4, 6], [11], [8, 10]]
    for table, n in zip(tables, seq_lens, strict=True):  # poison what no sequence may read
        k_cache[table[-1], n - (len(table) - 1) * bsz :] = float("nan")
        v_cache[table[-1], n - (len(table) - 1) * bsz :] = float("nan")
    k_cache[0] = v_cache[0] = float("nan")
    batch = make_batch(query_lens, seq_lens, tables, bsz)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    want = paged_attention_ref(q, k_cache, v_cache, batch)
    got = paged_attention_torch(q, k_cache, v_cache, batch)
    assert not got.isnan().any()
    assert (got - want).abs().max().item() < 1e-5


def test_gguf_rope_rows_round_trip() -> None:
    """llama.cpp's converter interleaves each head's two halves; unpermuting restores them."""
    heads, head_dim = 3, 8
    w = torch.arange(heads * head_dim * 2, dtype=torch.float32).reshape(heads * head_dim, 2)
    permuted = (
        w.reshape(heads, 2, head_dim // 2, 2).transpose(1, 2).reshape(w.shape)
    )  # row 2i <- row i, row 2i+1 <- row i + D/2
    assert torch.equal(permuted[1], w[head_dim // 2]) and torch.equal(permuted[2], w[1])
    assert torch.equal(unpermute_rope_rows(permuted, heads), w)
