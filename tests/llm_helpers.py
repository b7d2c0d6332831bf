"""Shared pieces of the LLM engine tests: a tiny random Llama saved as a Hugging Face folder,
Hugging Face's own greedy generation as the oracle, and an engine built on the model worker."""

from __future__ import annotations

from pathlib import Path

import torch

from kvspec.impl.llm.llama import LlamaWeights, PagedLlama
from kvspec.impl.llm.model_worker import ModelWorker
from kvspec.impl.paged.kv_cache import KVCache
from kvspec.reference import Choices, Engine, EngineConfig

TINY = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def save_tiny_llama(folder: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """A random-weight ``LlamaForCausalLM`` (float32), saved to ``folder`` as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():  # larger weights than the init's: sharper, more varied logits
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(folder)
    return model


class HFOracle:
    """Hugging Face greedy ``generate`` per prompt (cached): tokens and per-token logits."""

    def __init__(self, model, max_new_tokens: int) -> None:  # type: ignore[no-untyped-def]
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.cache: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def __call__(self, prompt: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
        if prompt not in self.cache:
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logits = torch.stack([step[0] for step in out.logits]).float()
            self.cache[prompt] = (tokens, logits)
        return self.cache[prompt]


def model_engine(
    weights: LlamaWeights,
    config: EngineConfig,
    backend: str,
    choices: Choices | None = None,
    record: bool = False,
) -> tuple[Engine, ModelWorker]:
    cfg = weights.config
    cache = KVCache.allocate(
        cfg.num_layers, config.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim
    )
    for t in (*cache.k, *cache.v):
        t.zero_()
    worker = ModelWorker(PagedLlama(weights, cache, backend), record_logits=True)
    return Engine(config, choices, record=record, worker=worker), worker
