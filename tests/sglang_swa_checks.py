"""SGLang 0.5.23's hybrid sliding-window model through the adapter (``sglang_adapter/swa.py``),
run inside ``.venv-sglang`` by ``tests/test_sglang_swa.py``:
``python tests/sglang_swa_checks.py CASE...`` prints one line per case.

* ``build``: the tree cache ``swa_memory`` gets from SGLang's ``create_tree_cache`` (class,
  components, ``TreeCore``) and what SGLang read off ``build.SWA_MODEL`` (window, layer ids);
* ``replay:N``: N seeded random workloads (shared prefixes, both loops); after every loop
  iteration the pages the events registered are the tree's (``self_check``) and each running
  request's per-group tables replayed from the events are SGLang's (its row and the SWA pages
  paired with it that it holds), and the tree's SWA pages SGLang has locked are those the tables
  hold (``locks_agree``). Prints the first difference or ``none``, the events by kind (with ``/g`` for
  those carrying a group) and the hybrid paths reached (``SwaRecorder.paths``);
* ``seeds:S1,S2``: ``replay`` on those seeds only;
* ``early-free:N``: ``replay:N`` on the planted ``mutants.EarlyWindowFree`` (the recorder as
  faithful to it as to SGLang; its window frees reach blocks the next forward reads);
* ``refused``: whether the spec follows several groups (``loops.spec_follows_groups``) and what
  ``swa_factory`` then says of a cell: built, or refused by name;
* ``judge:NAME``: ``kvspec fuzz`` on a hybrid SWA factory (``JUDGED``), one line as
  ``thirdparty_checks.kvspec`` prints it; ``judge-trace``: the planted bug's counterexample as a
  v1 trace file, then ``kvspec check`` on it (two lines).
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from typing import Any

from kvspec.conformance.adapters import sglang_adapter
from kvspec.conformance.adapters.sglang_adapter.build import (
    SWA_MODEL,
    core_backend,
    swa_layers,
    swa_memory,
)
from kvspec.conformance.adapters.sglang_adapter.loops import SglangAdapter, spec_follows_groups
from kvspec.reference.choices import RandomChoices
from kvspec.spec import Config

CELL = dict(
    block_size=2,
    max_running=3,
    token_budget=8,
    policy="engine-registers",
    discipline="general",
    preemption="fcfs",
    stop_token=0,
)


def build() -> None:
    _pool, _allocator, tree = swa_memory(2, 6, 6, 3)
    parts = "+".join(sorted(c.name for c in tree.components))
    window, swa, full = swa_layers()
    print(
        f"{type(tree).__name__} {parts} {core_backend(tree)} window {window} swa layers {swa} "
        f"full layers {full} of {SWA_MODEL['architectures'][0]}"
    )


class Tables:
    """Each running request's per-group tables, replayed from the adapter's events. A ``free``
    that neither follows a ``preempt`` or ``abort`` nor precedes its request's ``finish`` (a
    release) is a window free: the position that names the block becomes null."""

    def __init__(self) -> None:
        self.tables: dict[int, list[list[int]]] = {}
        self.pending: list[int] = []
        self.releasing = False

    def apply(self, event: tuple[Any, ...]) -> None:
        kind, group = event[0], _group(event)
        if kind == "free":
            if not self.releasing:
                self.pending.append(event[1])
            return
        if kind != "finish":
            self.flush()
        self.pending = []
        if kind in ("preempt", "abort"):
            self.releasing = True
        elif kind != "unpublish":
            self.releasing = False
        if kind in ("preempt", "finish", "abort"):
            self.tables.pop(event[1], None)
        elif kind == "hit":
            self.tables.setdefault(event[1], [[], []])[group] = list(event[2])
        elif kind == "alloc":
            self.tables.setdefault(event[1], [[], []])[group].append(event[2])
        elif kind == "dedup":
            self.tables[event[1]][group][event[2]] = event[3]

    def flush(self) -> None:
        """Apply the window frees seen last (at the end of a loop iteration, nothing follows)."""
        for block in self.pending:
            for tables in self.tables.values():
                window = tables[1]
                if block in window:
                    window[window.index(block)] = 0
        self.pending = []


def sglang_state(adapter: Any) -> str | None:
    """What SGLang's own pools say of the tables the adapter reads: a group-1 table holds SWA
    pages (or null), a group-0 table FULL pages, and no block a running request's table names
    is in either pool's free list."""
    s = adapter.scheduler
    record, full = s.record, s.full_pages
    free = record.free_pages()
    for req in s.holders():
        tables = record.tables(req)
        if any(not 1 <= b <= full for b in tables[0]) or any(
            b and not full < b < 2 * full + 1 for b in tables[1]
        ):
            return f"r{req.rid}'s tables {tables} hold a block of the other pool"
        held = {b for table in tables for b in table if b} & free
        if held:
            return f"r{req.rid}'s tables {tables} name blocks {sorted(held)} SGLang has free"
    return locks_agree(adapter)


def locks_agree(adapter: Any) -> str | None:
    """SGLang's Rust core says which of the tree's SWA pages are unlocked (``walk_for_kv_canary``);
    the adapter's SWA tables say which a request holds (its lock's extent, ``SwaRecorder``): a
    tree SWA page is locked exactly when some request's SWA table holds it."""
    s = adapter.scheduler
    record = s.record
    tree = {record.swa_block(p) for p in record._walk_swa(False)} - {0}
    unlocked = {record.swa_block(p) for p in record._walk_swa(True)} - {0}
    held = {b for req in s.holders() for b in record.tables(req)[1] if b}
    if (tree & held) & unlocked or (tree - held) - unlocked:
        return (
            f"SGLang's tree SWA pages {sorted(tree)}, unlocked {sorted(unlocked)}; the tables "
            f"hold {sorted(tree & held)}"
        )
    return None


def _group(event: tuple[Any, ...]) -> int:
    sizes = {"hit": 4, "alloc": 4, "dedup": 5, "publish": 5}
    return event[-1] if sizes.get(event[0]) == len(event) else 0


def one_run(
    seed: int, overlap: bool, kinds: Counter[str], paths: Counter[str], adapter_class: Any = None
) -> str | None:
    rng = random.Random(seed)
    config = Config(num_blocks=rng.choice([6, 8, 10]), depth=2 if overlap else 1, **CELL)  # type: ignore[arg-type]
    adapter = (adapter_class or SglangAdapter)(
        config, RandomChoices(seed), overlap=overlap, tree="swa"
    )
    base = [rng.randrange(1, 4) for _ in range(12)]
    replay, seen, rid = Tables(), 0, 0
    for i in range(120):
        if i < 40 and rng.random() < 0.3 and rid < 8:
            n = rng.randrange(1, 12)
            shared = rng.random() < 0.7
            prompt = tuple(base[:n]) if shared else tuple(rng.randrange(1, 4) for _ in range(n))
            adapter.add_request(rid, prompt, rng.randrange(1, 7), 0)
            rid += 1
        if not adapter.step() and i >= 40:
            break
        for event in adapter.events[seen:]:
            kind = "let-go" if event[0] == "dedup" and event[3] == 0 else str(event[0])
            kinds[f"{kind}/g" if _group(event) else kind] += 1
            replay.apply(event)
        seen = len(adapter.events)
        where = f"seed {seed} {'overlap' if overlap else 'sync'} iteration {i}"
        why = adapter.self_check()
        if why:
            paths.update(adapter.scheduler.record.paths)
            return f"{where}: {why}"
        replay.flush()
        why = sglang_state(adapter)
        if why:
            paths.update(adapter.scheduler.record.paths)
            return f"{where}: {why}"
        s = adapter.scheduler
        for req in s.holders():
            if req.is_retracted:
                continue
            theirs = s.record.tables(req)
            ours = replay.tables.get(int(req.rid))
            if ours != theirs:
                paths.update(s.record.paths)
                return f"{where}: r{req.rid}'s tables are {theirs} in SGLang, {ours} by the events"
    paths.update(s.record.paths)
    return None


PATHS = (
    "hits cut by the SWA window",
    "hits with null window blocks",
    "hits with a null block inside the window",
    "window frees beside a cached FULL page",
    "window frees of a block the next forward reads",
    "window frees of an SWA page in the tree (shared)",
)


def replay(runs: int | list[int], adapter_class: Any = None) -> None:
    kinds: Counter[str] = Counter()
    paths: Counter[str] = Counter()
    found = None
    for seed in range(runs) if isinstance(runs, int) else runs:
        for overlap in (True, False):
            why = one_run(seed, overlap, kinds, paths, adapter_class)
            found = found or why
    paths.update(dict.fromkeys(PATHS, 0))  # every path named, reached or not
    print(
        f"{found or 'none'} | {' '.join(f'{k}={v}' for k, v in sorted(kinds.items()))} | "
        + ", ".join(f"{k}={v}" for k, v in sorted(paths.items()))
    )


def refused() -> None:
    config = Config(num_blocks=8, depth=2, **CELL)  # type: ignore[arg-type]
    follows = "follows" if spec_follows_groups() else "does-not-follow"
    try:
        sglang_adapter.swa_factory(config, RandomChoices(0))
        print(f"{follows} built")
    except ValueError as refusal:
        print(f"{follows} refused: {refusal}")


SWA_CELL = ("--policy", "engine-registers", "--discipline", "general")
JUDGED = {
    "overlap": ("sglang_adapter:swa_factory", "2", "10"),
    "sync": ("sglang_adapter:swa_sync_factory", "1", "10"),
    "early-free": ("sglang_adapter.mutants:early_window_free_swa_factory", "2", "30"),
}
"""``judge:NAME``: (factory, depth, seconds): SGLang's two loops over the hybrid SWA tree, 10 s
each (seed 0), and the planted ``mutants.EarlyWindowFree``, up to 30 s (the MAMBA factory's
are ``tests/sglang_mamba_checks.py``'s)."""


def judge(name: str) -> None:
    from thirdparty_checks import kvspec

    target, depth, seconds = JUDGED[name]
    target = f"kvspec.conformance.adapters.{target}"
    kvspec("fuzz", "--target", target, *SWA_CELL, "--depth", depth, "--seconds", seconds)


def judge_trace() -> None:
    """The planted ``EarlyWindowFree``'s counterexample written as a v1 trace (its let-go a
    ``dedup`` to block 0 in group 1), then ``kvspec check`` on that file: two lines."""
    import tempfile
    from pathlib import Path

    from thirdparty_checks import kvspec

    target, depth, seconds = JUDGED["early-free"]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "early-free.json")
        fuzz = ("fuzz", "--target", f"kvspec.conformance.adapters.{target}", *SWA_CELL)
        kvspec(*fuzz, "--depth", depth, "--seconds", seconds, "--out", out, "--format", "v1")
        kvspec("check", out)


if __name__ == "__main__":
    for case in sys.argv[1:]:
        name, _, arg = case.partition(":")
        if name == "build":
            build()
        elif name == "replay":
            replay(int(arg))
        elif name == "seeds":
            replay([int(seed) for seed in arg.split(",")])
        elif name == "early-free":
            from kvspec.conformance.adapters.sglang_adapter.mutants import EarlyWindowFree, mutant

            replay(int(arg), mutant(EarlyWindowFree))
        elif name == "refused":
            refused()
        elif name == "judge":
            judge(arg)
        elif name == "judge-trace":
            judge_trace()
        else:
            raise SystemExit(f"unknown case {case}")
