"""SGLang 0.5.23's hybrid linear-attention model through the adapter (``sglang_adapter/mamba.py``),
run inside ``.venv-sglang`` by ``tests/test_sglang_mamba.py``:
``python tests/sglang_mamba_checks.py CASE...`` prints one line per case.

* ``build``: what SGLang's own resolution pass makes of ``mamba.MAMBA_MODEL`` (strategy, overlap),
  and the tree cache ``mamba_memory`` gets from SGLang's ``create_tree_cache`` (class,
  components, ``TreeCore``, the pool's class and state slots);
* ``replay:N``: N seeded random workloads (shared prefixes, chunked prefills, SGLang's retraction test mode on odd seeds) through
  ``SglangAdapter(tree="mamba")``, over SGLang's default Rust ``TreeCore``; after every loop
  iteration the events replayed by ``Replay`` (independent of the adapter's views) give each
  running request SGLang's FULL row and its own state slot, the tree's states as
  ``all_mamba_values_flatten`` lists them, each hit's state the tree's state at the FULL hit's
  end, and SGLang's free state slots as the slots neither a
  request nor the tree holds. Prints the first difference or ``none``, the events by kind (``/g``
  for those carrying a group) and the hybrid paths reached (``MambaRecorder.paths``);
* ``python:N``: ``replay:N`` over SGLang's Python ``TreeCore``, whose nodes Python can read:
  besides, each tree state sits on a node whose key is as long as its ``snapshot`` said
  (``i + 1``), and the states SGLang has locked (``lock_ref``) are those the adapter counts
  (``MambaRecorder.locked_states``, which the Rust core's refcounts rest on);
* ``extra``: what SGLang's resolution makes of ``mamba.EXTRA_MODEL`` (Qwen3-Next), with and
  without overlap;
* ``seeds:S1,S2``: ``replay`` on those seeds only;
* ``judge:NAME``: ``kvspec fuzz`` on a MAMBA factory (``JUDGED``), one line as
  ``thirdparty_checks.kvspec`` prints it; ``judge-trace``: the planted ``ShortSnapshot``'s
  counterexample as a v1 trace file, then ``kvspec check`` on it (two lines); ``extra-trace``
  the same for the planted ``DonateOtherSlot`` (one line, the two joined by `` || ``);
* ``extra-replay:N`` (``extra-seeds:S1,S2``, ``extra-python:N``): ``replay`` through
  ``mamba_extra_factory``'s adapter (``sglang_adapter/extra.py``: extra_buffer, the overlap
  loop), the events replayed by ``ExtraReplay`` (a donation leaves a hole in the slot table that
  the fresh slot's ``alloc`` fills).
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter
from typing import Any

from kvspec.conformance.adapters.sglang_adapter import mamba
from kvspec.conformance.adapters.sglang_adapter.build import ComponentType, core_backend
from kvspec.conformance.adapters.sglang_adapter.loops import SglangAdapter
from kvspec.reference.choices import RandomChoices
from kvspec.spec import Config

CELL = dict(
    block_size=1,
    max_running=3,
    token_budget=6,
    policy="engine-registers",
    discipline="general",
    preemption="fcfs",
    stop_token=0,
)


MAMBA_CELL = ("--policy", "engine-registers", "--discipline", "general")
JUDGED = {
    "mamba": ("sglang_adapter:mamba_factory", "1", "20"),
    "retract": ("sglang_adapter:mamba_retract_factory", "1", "20"),
    "short": ("sglang_adapter.mutants:short_snapshot_mamba_factory", "1", "30"),
    "skip-cow": ("sglang_adapter.mutants:skip_cow_mamba_factory", "1", "30"),
    "overlap": ("sglang_adapter:mamba_factory", "2", "5"),
    "extra": ("sglang_adapter:mamba_extra_factory", "2", "10"),
    "extra-fixed": ("sglang_adapter:mamba_extra_fixed_factory", "2", "5"),
    "donate-other": ("sglang_adapter.extra_mutants:donate_other_slot_factory", "2", "5"),
    "short-key": ("sglang_adapter.extra_mutants:short_track_key_factory", "2", "5"),
}
"""``judge:NAME``: (factory, depth, seconds): ``mamba_factory`` and its retraction test mode,
20 s each (seed 0); the planted ``mutants.ShortSnapshot`` and ``mutants.SkipCow``, up to 30 s
each; ``mamba_factory`` at
depth 2, refused (SGLang's auto strategy forces the loop without overlap); ``mamba_extra_factory``
(Qwen3-Next, extra_buffer under overlap, depth 2, up to 10 s: SGLang's missed ping-pong flip,
named StateAtItsBoundary), ``mamba_extra_fixed_factory`` (the flip made, 5 s, no
counterexample), the planted ``extra_mutants.DonateOtherSlot`` and ``ShortTrackKey`` (up to
5 s each)."""


def judge(name: str) -> None:
    from thirdparty_checks import kvspec

    target, depth, seconds = JUDGED[name]
    target = f"kvspec.conformance.adapters.{target}"
    kvspec("fuzz", "--target", target, *MAMBA_CELL, "--depth", depth, "--seconds", seconds)


def judge_trace(name: str = "short") -> None:
    """The planted ``ShortSnapshot``'s counterexample (``JUDGED[name]``'s) written as a v1 trace
    (a ``slot`` group in its header, ``snapshot`` events; ``track`` ones for an extra_buffer
    plant), then ``kvspec check`` on that file: two lines."""
    import tempfile
    from pathlib import Path

    from thirdparty_checks import kvspec

    target, depth, seconds = JUDGED[name]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / f"{name}.json")
        fuzz = ("fuzz", "--target", f"kvspec.conformance.adapters.{target}", *MAMBA_CELL)
        kvspec(*fuzz, "--depth", depth, "--seconds", seconds, "--out", out, "--format", "v1")
        kvspec("check", out)


def extra_trace() -> None:
    """``judge_trace`` of the planted ``DonateOtherSlot`` (extra_buffer), its two lines joined by
    `` || `` into one."""
    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        judge_trace("donate-other")
    print(" || ".join(said.getvalue().strip().splitlines()))


def extra() -> None:
    """What SGLang's resolution makes of ``mamba.EXTRA_MODEL`` (Qwen3-Next) with its default
    overlap loop, and with ``--disable-overlap-schedule``: one line."""
    on, off = dict(mamba.extra_resolved()), dict(mamba.extra_resolved(True))
    print(
        f"{mamba.EXTRA_MODEL['architectures'][0]} overlap {on['mamba_radix_cache_strategy']} "
        f"overlap-off {on.get('disable_overlap_schedule', False)}; disabled "
        f"{off['mamba_radix_cache_strategy']} overlap-off {off.get('disable_overlap_schedule')}"
    )


def build() -> None:
    strategy = dict(mamba.resolved())
    pool, _allocator, tree = mamba.mamba_memory(1, 8, mamba.slots_for(3), 3)
    parts = "+".join(sorted(c.name for c in tree.components))
    print(
        f"{strategy['mamba_radix_cache_strategy']} overlap-off {strategy['disable_overlap_schedule']} "
        f"{type(tree).__name__} {parts} {core_backend(tree)} {type(pool).__name__} "
        f"slots {pool.mamba_allocator.available_size()} of "
        f"{mamba.MAMBA_MODEL['architectures'][0]}"
    )


class Replay:
    """The adapter's events replayed: each running request's FULL table and its own slot, the
    tree's values (pages and states) with their positions."""

    def __init__(self, full_pages: int) -> None:
        self.full = full_pages
        self.tables: dict[int, list[list[int]]] = {}
        self.tree: dict[int, int] = {}
        self.wrong: list[str] = []
        """What the events said that cannot be (``check_hit``)."""

    def apply(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        group = event[-1] if kind in ("hit", "alloc") and len(event) == 4 else 0
        if kind == "snapshot":
            group = event[4]
        if kind in ("preempt", "finish", "abort"):
            self.tables.pop(event[1], None)
        elif kind == "hit":
            tables = self.tables.setdefault(event[1], [[], []])
            if group == 0:
                tables[0] = list(event[2])
            else:
                self.check_hit(event[1], len(tables[0]), event[2])
        elif kind == "alloc":
            self.tables.setdefault(event[1], [[], []])[group].append(event[2])
        elif kind == "dedup":
            self.tables[event[1]][0][event[2]] = event[3]
        elif kind in ("publish", "snapshot"):
            self.tree[event[3]] = event[2]
        elif kind in ("evict", "unpublish"):
            self.tree.pop(event[1], None)
        elif kind == "reset":
            self.tree.clear()

    def check_hit(self, req: int, full: int, src: tuple[int, ...]) -> None:
        """A hit copies the state at the FULL hit's end: one the tree holds, its snapshot's
        length the hit's (SGLang matches no further than a node with a state)."""
        if not full and not src:
            return
        if len(src) != 1 or self.tree.get(src[0], -2) + 1 != full:
            where = {b: self.tree.get(b) for b in src}
            self.wrong.append(f"r{req} hit {full} FULL pages and states {where}")

    def states(self) -> dict[int, int]:
        return {b: i for b, i in self.tree.items() if b > self.full}


class ExtraReplay(Replay):
    """``Replay`` with track slots (``sglang_adapter/extra.py``): a running request's snapshot of
    one of its track slots leaves a hole in its slot table, which its next slot ``alloc`` fills;
    ``track`` writes change no table."""

    def apply(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "snapshot" and event[1] in self.tables and event[3] in self.tables[event[1]][1]:
            slots = self.tables[event[1]][1]
            slots[slots.index(event[3])] = None  # type: ignore[call-overload]
        elif kind == "alloc" and len(event) == 4 and None in self.tables.get(event[1], [[], []])[1]:
            slots = self.tables[event[1]][1]
            slots[slots.index(None)] = event[2]  # type: ignore[call-overload]
            return
        super().apply(event)


def differences(adapter: SglangAdapter, replay: Replay, python_core: bool) -> str | None:
    s = adapter.scheduler
    record = s.record
    if replay.wrong:
        return replay.wrong[0]
    for req in s.holders():
        ours = replay.tables.get(int(req.rid))
        theirs = record.tables(req)
        if ours != theirs:
            return f"r{req.rid}: SGLang's row and slot {theirs}, the events' {ours}"
    states = replay.states()
    tree_states = {record.block(v) for v in s.tree.tree_core.all_mamba_values_flatten().tolist()}
    if set(states) != tree_states:
        return f"SGLang's tree states {sorted(tree_states)}, the events' {sorted(states)}"
    slots = set(range(s.full_pages + 1, s.full_pages + s.slots + 1))
    owned = {b for tables in replay.tables.values() for b in tables[1]}
    free = {record.block(q) for q in s.pool.mamba_allocator.free_slots.tolist()}
    if free != slots - owned - set(states):
        return (
            f"SGLang's free slots {sorted(free)}, the events leave free "
            f"{sorted(slots - owned - set(states))}"
        )
    why = adapter.self_check()
    if why:
        return why
    if python_core:
        return node_truth(adapter, states)
    return None


def node_truth(adapter: SglangAdapter, states: dict[int, int]) -> str | None:
    """The Python ``TreeCore``'s nodes: each state's key length, and which states are locked."""
    s = adapter.scheduler
    record = s.record
    core = s.tree.tree_core
    depth_of: dict[int, int] = {}
    locked: Counter[int] = Counter()
    stack = [(core.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        if node is not core.root_node:
            depth += len(node.key)
            data = node.component_data[ComponentType.MAMBA]
            if data.value is not None:
                block = record.block(data.value.view(-1)[0])
                depth_of[block] = depth
                if data.lock_ref:
                    locked[block] = data.lock_ref
        stack += [(child, depth) for child in node.children.values()]
    wrong = {b: (i + 1, depth_of.get(b)) for b, i in states.items() if depth_of.get(b) != i + 1}
    if wrong:
        return f"states whose snapshot length differs from their node's key: {wrong}"
    counted = +record.locked_states(s.holders())
    if counted != locked:
        return f"SGLang's locked states {dict(locked)}, the adapter counts {dict(counted)}"
    return None


def workload(
    seed: int, python_core: bool, extra: bool = False
) -> tuple[str | None, Counter[str], Counter[str]]:
    rng = random.Random(seed)
    config = Config(num_blocks=rng.choice((10, 16, 24)), **CELL)
    retract = seed % 2 == 1  # SGLang's retraction test mode on odd seeds (retract_factory)
    if extra:  # extra_buffer under SGLang's overlap loop (sglang_adapter/extra.py)
        from kvspec.conformance.adapters.sglang_adapter.extra import ExtraAdapter

        adapter: SglangAdapter = ExtraAdapter(config, RandomChoices(seed), test_retract=retract)
    else:
        adapter = SglangAdapter(
            config, RandomChoices(seed), overlap=False, tree="mamba", test_retract=retract
        )
    if (core_backend(adapter.scheduler.tree) == "python") != python_core:
        raise RuntimeError(f"wanted the {'Python' if python_core else 'Rust'} TreeCore")
    replay = (ExtraReplay if extra else Replay)(adapter.scheduler.full_pages)
    bases = [[rng.randrange(1, 4) for _ in range(8)] for _ in range(2)]
    seen, arrivals = 0, 0
    for iteration in range(80):
        burst = rng.choice((0, 0, 1, 3)) if arrivals < 12 else 0
        for _ in range(burst):  # bursts, so that decodes run several requests (retraction)
            base = rng.choice(bases)
            prompt = base[: rng.randrange(1, 9)] + [rng.randrange(1, 4)] * rng.randrange(0, 3)
            adapter.add_request(arrivals, tuple(prompt), rng.randrange(1, 9), 0)
            arrivals += 1
        if rng.random() < 0.05 and arrivals:
            adapter.abort(rng.randrange(arrivals))
        if rng.random() < 0.01:
            adapter.reset_prefix_cache()
        adapter.step()
        for event in adapter.events[seen:]:
            replay.apply(event)
        seen = len(adapter.events)
        why = differences(adapter, replay, python_core)
        if why:
            return f"seed {seed} iteration {iteration}: {why}", Counter(), Counter()
    kinds = Counter(
        e[0]
        + (
            "/g"
            if (e[0] in ("hit", "alloc") and len(e) == 4) or e[0] in ("snapshot", "track")
            else ""
        )
        for e in adapter.events
    )
    return None, kinds, adapter.scheduler.record.paths  # type: ignore[attr-defined]


def replay(seeds: list[int], python_core: bool = False, extra: bool = False) -> None:
    kinds: Counter[str] = Counter()
    paths: Counter[str] = Counter()
    for seed in seeds:
        why, k, p = workload(seed, python_core, extra)
        if why:
            print(why)
            return
        kinds += k
        paths += p
    print(f"none {dict(sorted(kinds.items()))} {dict(sorted(paths.items()))}")


def main(cases: list[str]) -> None:
    for case in cases:
        name, _, arg = case.partition(":")
        if name == "build":
            build()
        elif name == "replay":
            replay(list(range(int(arg))))
        elif name == "seeds":
            replay([int(x) for x in arg.split(",")])
        elif name == "extra-replay":
            replay(list(range(int(arg))), extra=True)
        elif name == "extra-seeds":
            replay([int(x) for x in arg.split(",")], extra=True)
        elif name == "extra-python":
            os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
            try:
                replay(list(range(int(arg))), python_core=True, extra=True)
            finally:
                del os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"]
        elif name == "judge":
            judge(arg)
        elif name == "extra":
            extra()
        elif name == "judge-trace":
            judge_trace()
        elif name == "extra-trace":
            extra_trace()
        elif name == "python":
            os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
            try:
                replay(list(range(int(arg))), python_core=True)
            finally:
                del os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"]
        else:
            raise SystemExit(f"unknown case {case!r}")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
