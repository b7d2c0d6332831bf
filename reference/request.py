"""Per-request and per-step records: ``Request``, a step's ``Entry`` per request, ``Step``."""

from __future__ import annotations

import zlib

from .block_pool import Block
from .hashing import pack_token

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Request:
    __slots__ = (
        "rid",
        "tokens",
        "prompt_len",
        "max_tokens",
        "priority",
        "arrival",
        "external",
        "status",
        "table",
        "computed",
        "cached",
        "loading",
        "block_hashes",
        "crc",
        "admissions",
        "placeholders",
        "holding",
        "drafts",
        "tables",
        "read_limit",
        "encoder",
    )

    def __init__(
        self,
        rid: int,
        prompt: tuple[int, ...],
        packed: bytes,
        max_tokens: int,
        priority: int,
        arrival: int,
        external: bool,
    ) -> None:
        self.rid = rid
        self.tokens: list[int] = list(prompt)
        """Prompt then sampled tokens."""
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival = arrival
        self.external = external
        """Its prompt's full blocks can be loaded from an external KV store (until a load fails)."""
        self.status = WAITING
        self.table: list[Block] = []
        """Block table; replaced (never cleared in place) on free, so steps may keep a reference."""
        self.computed = 0
        """Tokens written or scheduled to be written (``num_computed_tokens``)."""
        self.cached = 0
        """Leading table blocks registered, or tracked for registration (``num_cached_block``)."""
        self.loading: int | None = None
        """The step of an external load not yet committed."""
        self.block_hashes: list[bytes] = []
        """Chained hashes of the full blocks, computed on demand and kept as tokens grow."""
        self.crc = zlib.crc32(packed)
        """crc32 of all tokens' bytes: the fake model's sample is ``crc % vocab``."""
        self.admissions = 0
        """How many times it was admitted (more than once after preemptions, failed loads)."""
        self.placeholders = 0
        """Async scheduling: the tokens that steps in flight may sample for it and whose samples
        will be used (vLLM's ``num_output_placeholders``): one per such step, and with draft
        tokens one more per draft (scheduled as if accepted); it may be scheduled up to
        ``len(tokens)`` plus this many positions. Always 0 without async scheduling."""
        self.holding = 0
        """With stale output delivered: steps in flight whose output holds an entry for it; a
        preempted request is not admitted again until this is 0. Always 0 in drop mode."""
        self.read_limit: int | None = None
        """The engine's bound on its prefix-cache hit in tokens at every admission (vLLM's
        ``prefix_cache_hit_limit``; 0 skips the read), or None: unbounded. Its admissions'
        ``schedule`` events carry it (the spec's bounded-hit rule)."""
        self.encoder = 0
        """Its encoder tokens (an encoder-decoder model's input, ``Engine.add_request``): a cross
        group's table holds ``ceil(encoder / B_g)`` blocks while it runs; 0 without."""
        self.tables: list[list[Block]] = []
        """Several KV-cache groups: one table per group, ``table`` first (``groups.GroupedKV``
        keeps them); empty with one group."""
        self.drafts = 0
        """Speculative decoding: draft tokens proposed for its next decode (vLLM's
        ``spec_token_ids``), set after each of its samples (under async scheduling when a decode
        that samples is scheduled), used (and cleared) when scheduled."""

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    def append_token(self, token: int) -> None:
        self.tokens.append(token)
        self.crc = zlib.crc32(pack_token(token), self.crc)

    def __repr__(self) -> str:
        return (
            f"Request(r{self.rid}, {self.status}, tokens={len(self.tokens)}, "
            f"computed={self.computed}, blocks={[b.block_id for b in self.table]})"
        )


class Entry:
    """A request's part in a step: compute (or load) tokens ``start .. end - 1``; the step reads
    and writes ``table[:num_blocks]`` (``table`` is the request's table object at the time).
    ``samples``: it reaches the end of the request's tokens as the steps in flight see them
    (known ones, then one placeholder per step in flight that samples for it), so it samples the
    next one. Under async scheduling ``end`` may run past the tokens known at scheduling time;
    they are all known when the step executes (its older steps have committed by then) unless
    their sample was discarded, in which case the entry is no longer live."""

    __slots__ = (
        "start",
        "end",
        "table",
        "num_blocks",
        "load",
        "samples",
        "drafts",
        "loaded",
        "tables",
        "encoded",
    )

    def __init__(
        self,
        start: int,
        end: int,
        table: list[Block],
        num_blocks: int,
        load: bool,
        samples: bool,
        drafts: int = 0,
        loaded: int = 0,
    ) -> None:
        self.start = start
        self.end = end
        self.table = table
        self.num_blocks = num_blocks
        self.load = load
        """An asynchronous load: the step computes nothing for the request, which waits for it."""
        self.samples = samples
        self.drafts = drafts
        """Draft tokens past the known ones (its last ``drafts`` positions): it samples 1 ..
        drafts + 1 tokens."""
        self.tables: tuple[tuple[tuple[int, int], ...], ...] | None = None
        """Several KV-cache groups: every group's table as (block id, generation) pairs when it
        was scheduled (``groups.GroupedKV.snapshot``)."""
        self.encoded: tuple[tuple[int, int], ...] = ()
        """A cross group's (group, position) this entry's encoder pass writes: every block the
        schedule allocated there (``groups.GroupedKV.grow``), at the request's admission."""
        self.loaded = loaded
        """Full blocks loaded from the external store from ``start`` on; computed tokens after
        them make the load synchronous (landed before the forward pass reads it)."""


class Step:
    __slots__ = (
        "step_id",
        "entries",
        "live",
        "registrations",
        "group_registrations",
        "failed",
        "budget_used",
        "preempted",
        "admitted",
    )

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id
        self.entries: dict[int, Entry] = {}
        """The step's output, in scheduling order."""
        self.live: set[int] = set()
        """Requests whose results are still wanted: not aborted, finished or (with stale output
        dropped) preempted since."""
        self.registrations: dict[int, list[int]] = {}
        """Block indices registered (or hidden) while scheduling this step, per request."""
        self.group_registrations: dict[int, list[tuple[int, int]]] = {}
        """Several KV-cache groups: the (group, index) of groups 1 .. G - 1 so registered."""
        self.failed: tuple[int, ...] = ()
        self.budget_used = 0
        self.preempted = False
        self.admitted = False
