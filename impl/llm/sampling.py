"""Sampling parameters and the sampler: greedy, or seeded temperature / top-k / top-p sampling.

A request with a ``seed`` owns a ``torch.Generator`` seeded with it, drawn once per output
token, so its tokens do not depend on what else is in the batch, on preemptions or on the
engine's depth: the same seed gives the same tokens under any schedule (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0: greedy (argmax, the first maximum on ties, like ``transformers``)."""
    top_k: int = 0
    """0: no top-k cut."""
    top_p: float = 1.0
    seed: int | None = None
    """The request's generator seed (None: derived from the LLM's seed and the request id)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (kept in the output), besides the model's EOS."""
    ignore_eos: bool = False
    priority: int = 0
    """Lower runs first under priority preemption."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a ``[vocab]`` float32 logits row."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, -1).cumsum(-1)
        drop = cumulative - torch.softmax(ordered, -1) >= params.top_p  # keep the first past p
        scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, -1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
