"""The model worker: runs the reference engine's steps on a real model over the paged KV cache.

It implements ``kvspec.reference.worker.Worker``. ``execute`` turns a submitted step into one
forward of ``llama.PagedLlama``: every entry of the step (live or not, as a device runs what was
submitted) contributes its tokens ``start .. end - 1`` (read from ``req.tokens``: under async
scheduling too, every token of a live entry is known when the step executes, see
``reference/engine.py``; a non-live one may reach past them and computes garbage there), their
positions, their slots in the
entry's block table (the table object and length the scheduler recorded, so a request preempted
since still writes where it was told to), and the logits of its last token. ``sample`` then
turns the live sampling entries' logits into tokens with the request's ``SamplingParams`` and
generator. Nothing here decides anything about blocks: that is the engine's job, and a wrong
decision (a zombie hit) shows up as wrong K/V read, hence wrong tokens.

External KV loads are not modelled by a real model (there is no external store): a step with a
load entry is refused with an error.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from kvspec.impl.paged.batch import make_batch
from kvspec.reference.request import Request, Step

from .llama import PagedLlama, StepInput
from .sampling import SamplingParams, sample

GREEDY = SamplingParams()
GARBAGE_TOKEN = 0
"""The input a step computes at a placeholder position whose sample was discarded (the entry is
no longer live): on a device the previous step's output would be fed in anyway; nothing reads
that K/V as valid, which the spec checks."""


class ModelWorker:
    def __init__(self, model: PagedLlama, seed: int = 0, record_logits: bool = False) -> None:
        self.model = model
        self.block_size = model.cache.block_size
        self.device = model.cache.device
        self.seed = seed
        self.params: dict[int, SamplingParams] = {}
        """Per request id; requests not listed are greedy."""
        self.generators: dict[int, torch.Generator] = {}
        self.logits: dict[int, torch.Tensor] = {}
        """The last executed step's logits, per request whose entry samples."""
        self.recorded: dict[int, list[torch.Tensor]] | None = {} if record_logits else None
        """With ``record_logits``: per request, the logits of every token it sampled."""
        self.steps = 0
        self.tokens = 0
        self.seconds = 0.0
        self.decode_seconds = 0.0
        """Time in steps made of decodes only (one token per entry): the benchmark's split."""

    def execute(self, step: Step, requests: Mapping[int, Request]) -> tuple[int, ...]:
        started = time.perf_counter()
        bsz = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        samplers: list[int] = []
        for rid, entry in step.entries.items():
            if entry.load:
                raise ValueError(f"request {rid}: external KV loads are not supported by a model")
            req = requests[rid]
            table = [b.block_id for b in entry.table[: entry.num_blocks]]
            chunk = req.tokens[entry.start : entry.end]
            if len(chunk) < entry.end - entry.start:  # a discarded placeholder: garbage input
                chunk = chunk + [GARBAGE_TOKEN] * (entry.end - entry.start - len(chunk))
            tokens.extend(chunk)
            for pos in range(entry.start, entry.end):
                positions.append(pos)
                slots.append(table[pos // bsz] * bsz + pos % bsz)
            query_lens.append(entry.end - entry.start)
            seq_lens.append(entry.end)
            tables.append(table)
            if entry.samples:
                rows.append(len(tokens) - 1)
                samplers.append(rid)
        self.logits = {}
        if tokens:
            dev = self.device
            batch = make_batch(query_lens, seq_lens, tables, bsz, dev)
            step_input = StepInput(
                torch.tensor(tokens, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                torch.tensor(slots, dtype=torch.long, device=dev),
                batch,
                torch.tensor(rows, dtype=torch.long, device=dev),
            )
            logits = self.model.forward(step_input).cpu()
            self.logits = {rid: logits[i] for i, rid in enumerate(samplers)}
            self.tokens += len(tokens)
        self.steps += 1
        seconds = time.perf_counter() - started
        self.seconds += seconds
        if tokens and len(tokens) == len(query_lens):
            self.decode_seconds += seconds
        return ()

    def sample(self, step: Step, req: Request) -> int:
        rid = req.rid
        logits = self.logits[rid]
        params = self.params.get(rid, GREEDY)
        generator = None
        if not params.greedy:
            generator = self.generators.get(rid)
            if generator is None:
                seed = params.seed if params.seed is not None else self.seed * 1_000_003 + rid
                generator = torch.Generator().manual_seed(seed)
                self.generators[rid] = generator
        if self.recorded is not None:
            self.recorded.setdefault(rid, []).append(logits)
        return sample(logits, params, generator)

    def forget(self, rid: int) -> None:
        """Drop a finished request's parameters and generator."""
        self.params.pop(rid, None)
        self.generators.pop(rid, None)
