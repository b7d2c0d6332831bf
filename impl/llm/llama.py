"""A Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU) whose attention runs on the paged
KV cache: the model runner's math, one forward per engine step.

``LlamaConfig`` is the architecture (read from a Hugging Face ``config.json`` or GGUF metadata by
``weights.py``), ``LlamaWeights`` the tensors in Hugging Face's layout (``[out, in]`` linear
weights, RoPE in the "rotate half" convention), ``PagedLlama.forward`` one step: a flat batch of
tokens from several sequences (decodes and prefill chunks mixed), each layer writing the new
tokens' K/V into their slots first and then attending over each sequence's context through its
block table. Logits are computed only for the rows asked for (the last token of each entry).

Attention backends (``BACKENDS``): ``triton`` runs ``kernels.write_kv`` and
``kernels.paged_attention`` (the real path: on a GPU, or in Triton's CPU interpreter);
``torch`` runs ``attention_ref.write_kv_ref`` and ``attention_torch.paged_attention_torch``, the
same reads of the same paged cache through the same block tables, in plain torch, because the interpreter is far
too slow for a 30-layer model on a CPU (docs/engine.md has the measured times). The backend is
always chosen by the caller; nothing falls back from one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvspec.impl.paged.attention_ref import write_kv_ref
from kvspec.impl.paged.attention_torch import paged_attention_torch
from kvspec.impl.paged.batch import Batch
from kvspec.impl.paged.kv_cache import KVCache

BACKENDS = ("triton", "torch")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        sizes = (
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        if min(sizes) < 1:
            raise ValueError(f"every size of a Llama config must be >= 1, got {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} query heads cannot share {self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q: torch.Tensor
    """``[num_heads * head_dim, hidden]``."""
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class LlamaWeights:
    config: LlamaConfig
    embed: torch.Tensor
    """``[vocab, hidden]``."""
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    """``[vocab, hidden]`` (the embedding itself when tied)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Where the weights came from (``source``), for messages."""

    def to(self, dtype: torch.dtype, device: str | torch.device) -> LlamaWeights:
        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        layers = [LayerWeights(*(cast(getattr(w, f)) for f in _LAYER_FIELDS)) for w in self.layers]
        tied = self.lm_head is self.embed
        embed = cast(self.embed)
        return replace(
            self,
            embed=embed,
            layers=layers,
            norm=cast(self.norm),
            lm_head=embed if tied else cast(self.lm_head),
        )

    @property
    def num_parameters(self) -> int:
        tensors = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for w in self.layers:
            tensors.extend(getattr(w, f) for f in _LAYER_FIELDS)
        return sum(t.numel() for t in tensors)


_LAYER_FIELDS = ("input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rope:
    """Rotary position embedding, "rotate half" layout: dimension ``i < D/2`` pairs with
    ``i + D/2``, both rotated by ``position * theta^(-2i/D)``."""

    def __init__(self, head_dim: int, theta: float, device: str | torch.device) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.inv_freq = (1.0 / (theta**exponents)).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H, D]``; ``cos``/``sin`` ``[T, 1, D]`` float32."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@dataclass
class StepInput:
    """One forward's tensors: ``tokens``, ``positions`` and ``slots`` ``[T]`` (int64), the
    attention ``batch`` and the rows whose logits are wanted."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    batch: Batch
    logit_rows: torch.Tensor


class PagedLlama:
    def __init__(self, weights: LlamaWeights, cache: KVCache, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"attention backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
            )
        cfg = weights.config
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise ValueError("the KV cache does not fit the model (layers, KV heads, head dim)")
        self.weights = weights
        self.config = cfg
        self.cache = cache
        self.backend = backend
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cache.device)
        if backend == "triton":
            from ..paged.kernels import interpreting, paged_attention, write_kv

            if cache.device.type != "cuda" and not interpreting():
                raise ValueError(
                    "the triton backend on a CPU needs TRITON_INTERPRET=1 (set before triton "
                    "is imported); or use the torch backend"
                )

            self._write, self._attend = write_kv, paged_attention
        else:
            self._write, self._attend = write_kv_ref, paged_attention_torch

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Logits ``[len(logit_rows), vocab]`` in float32; writes every token's K/V."""
        cfg, w = self.config, self.weights
        x = w.embed[step.tokens]
        cos, sin = self.rope.cos_sin(step.positions)
        num_tokens = step.tokens.shape[0]
        hd = cfg.head_dim
        for layer, lw in enumerate(w.layers):
            h = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
            q = (h @ lw.q.T).view(num_tokens, cfg.num_heads, hd)
            k = (h @ lw.k.T).view(num_tokens, cfg.num_kv_heads, hd)
            v = (h @ lw.v.T).view(num_tokens, cfg.num_kv_heads, hd).contiguous()
            q = Rope.apply(q, cos, sin).contiguous()
            k = Rope.apply(k, cos, sin).contiguous()
            k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
            self._write(k, v, k_cache, v_cache, step.slots)
            attn = self._attend(q, k_cache, v_cache, step.batch)
            x = x + attn.reshape(num_tokens, cfg.num_heads * hd) @ lw.o.T
            h = rms_norm(x, lw.post_norm, cfg.rms_norm_eps)
            x = x + (torch.nn.functional.silu(h @ lw.gate.T) * (h @ lw.up.T)) @ lw.down.T
        last = rms_norm(x[step.logit_rows], w.norm, cfg.rms_norm_eps)
        return (last @ w.lm_head.T).float()
