"""``LLM``: a small engine serving a Llama model through the reference scheduler and paged KV.

``LLM(model).generate(prompts, params)`` loads the weights (``weights.py``), allocates the
paged KV cache, and runs the reference ``Engine`` (any registration policy, discipline,
preemption mode and depth) with a ``model_worker.ModelWorker``. Prompts are strings (encoded
with the model's tokenizer) or lists of token ids. Each call adds its requests to the same
engine, so the prefix cache carries over between calls.

Stops: a request ends on its model's EOS (unless ``ignore_eos``) or one of its
``stop_token_ids`` (the token is kept), or at ``max_tokens``. The engine knows one global stop
token at most, so ``LLM`` ends stopped requests itself, right after the commit that sampled the
stop token (an ``abort``: without async scheduling the request is then in no step in flight,
its next token is not scheduled before that commit, see ``reference/engine.py``; with
``async_scheduling=True`` a later step may hold it, and the abort discards that step's output
for it), and reports ``"stop"``.

Choices: ``backend="auto"`` is ``triton`` on a CUDA device and ``torch`` on the CPU (Triton's
interpreter needs minutes per step for a 30-layer model there); the choice is printed by the
CLI and available as ``LLM.backend``, and an explicit ``backend`` is never replaced. The KV
cache starts zeroed, as a real engine's memory holds whatever it held: a zombie read then
reads plausible numbers (zeros), not NaN, and gives the plausible wrong tokens a user sees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvspec.impl.paged.kv_cache import DTYPES, KVCache
from kvspec.reference import Engine, EngineConfig
from kvspec.reference.request import FINISHED

from .llama import BACKENDS, LlamaWeights, PagedLlama
from .model_worker import ModelWorker
from .sampling import SamplingParams


@dataclass
class Output:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    text: str | None = None


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be auto, {' or '.join(BACKENDS)}, got {backend!r}")
    return backend


class LLM:
    def __init__(
        self,
        model: str | Path | LlamaWeights,
        *,
        policy: str = "deferred",
        depth: int = 1,
        discipline: str = "vllm",
        preemption: str = "fcfs",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_tokens: int = 8192,
        token_budget: int = 512,
        max_running: int = 16,
        prefix_caching: bool = True,
        async_scheduling: bool = False,
        backend: str = "auto",
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        tokenizer: bool = True,
        record_logits: bool = False,
        on_load: Callable[[str], None] | None = None,
    ) -> None:
        """``num_blocks`` (with the null block) defaults to ``kv_tokens / block_size + 1``.
        ``on_load`` is told each loading stage (the CLI's progress display)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.backend = resolve_backend(backend, dev)
        say = on_load or (lambda stage: None)
        self.tokenizer = None
        if isinstance(model, LlamaWeights):
            weights = model
        else:
            from .weights import load_tokenizer, load_weights

            say("weights")
            weights = load_weights(model)
            if tokenizer:
                say("tokenizer")
                self.tokenizer = load_tokenizer(model)
        say("cache")
        cfg = weights.config
        self.weights = weights.to(DTYPES[dtype], dev)
        if num_blocks is None:
            num_blocks = -(-kv_tokens // block_size) + 1
        self.config = EngineConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            depth=depth,
            policy=policy,
            discipline=discipline,
            preemption=preemption,
            token_budget=token_budget,
            max_running=max_running,
            prefix_caching=prefix_caching,
            async_scheduling=async_scheduling,
        )
        cache = KVCache.allocate(
            cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            DTYPES[dtype],
            dev,
        )
        for t in (*cache.k, *cache.v):
            t.zero_()
        self.model = PagedLlama(self.weights, cache, self.backend)
        self.worker = ModelWorker(self.model, seed, record_logits)
        self.engine = Engine(self.config, record=False, worker=self.worker)
        self.eos_token_id = cfg.eos_token_id
        self._next_id = 0

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass token ids")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        vocab = self.weights.config.vocab_size
        if not ids:
            raise ValueError("a prompt is empty")
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"a prompt holds token ids outside [0, {vocab})")
        return ids

    def decode(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_step: Callable[[int, int], None] | None = None,
    ) -> list[Output]:
        """One output per prompt, in order. ``on_step(tokens_done, tokens_max)`` is called after
        every engine step (the CLI's progress bar)."""
        if isinstance(params, SamplingParams) or params is None:
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        ids = [self.encode(p) for p in prompts]
        engine, worker = self.engine, self.worker
        rids = []
        for prompt_ids, p in zip(ids, plist, strict=True):
            rid = self._next_id
            self._next_id += 1
            try:
                engine.add_request(rid, tuple(prompt_ids), p.max_tokens, p.priority)
            except ValueError as err:  # leave nothing of this call behind
                for added in rids:
                    engine.abort(added)
                    worker.forget(added)
                raise ValueError(f"prompt {len(rids)}: {err}") from None
            worker.params[rid] = p
            rids.append(rid)
        stops = {
            rid: set(p.stop_token_ids)
            | (set() if p.ignore_eos or self.eos_token_id is None else {self.eos_token_id})
            for rid, p in zip(rids, plist, strict=True)
        }
        reasons: dict[int, str] = {}
        active = set(rids)
        total = sum(p.max_tokens for p in plist)
        requests = engine.requests
        committed = engine.scheduler.counters
        last_steps = committed["steps"]
        while engine.step():
            if committed["steps"] == last_steps:
                continue  # a step was scheduled, nothing committed
            last_steps = committed["steps"]
            done = 0
            for rid in list(active):
                req = requests[rid]
                if req.num_output and req.tokens[-1] in stops[rid]:
                    if req.status != FINISHED:
                        engine.abort(rid)
                    reasons[rid] = "stop"
                    active.discard(rid)
                elif req.status == FINISHED:
                    reasons[rid] = "length"
                    active.discard(rid)
            if on_step is not None:
                done = sum(
                    requests[r].max_tokens if r in reasons else requests[r].num_output for r in rids
                )
                on_step(done, total)
        outputs = []
        for rid, prompt_ids in zip(rids, ids, strict=True):
            req = requests[rid]
            out = req.tokens[req.prompt_len :]
            worker.forget(rid)
            outputs.append(
                Output(rid, prompt_ids, out, reasons.get(rid, "abort"), self.decode(out))
            )
        return outputs

    @property
    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.engine.stats)
        out.update(
            model_steps=self.worker.steps,
            model_tokens=self.worker.tokens,
            model_seconds=self.worker.seconds,
            model_decode_seconds=self.worker.decode_seconds,
        )
        return out
