"""Fixed workloads on a third-party engine, judged event by event; run inside that engine's venv
by ``tests/test_adapter_vllm.py``, ``tests/test_adapter_nano.py`` and ``tests/test_adapter_sglang.py``.

``python tests/thirdparty_checks.py ENGINE CASE...`` prints, per case, the first finding, or
``none`` with the number of events, their kinds, ``file`` and the exit code of ``kvspec check``
on the same events written as a trace file (and, for vLLM, ``cover`` and the counts of
``loop.Coverage``: the situations of async scheduling and stale output the workload went through).
ENGINE is ``vllm``, ``nano`` or ``sglang`` (its cases: ``SGLANG_CASES``, and ``SGLANG_KVSPEC``:
``kvspec`` commands run in the same process); CASE is ``seed`` (vLLM: the seed bug's shrunk
counterexample, depth 1), ``seed2`` (the same bug with a batch queue of 2 steps, vLLM without
async scheduling), ``stale`` (vLLM at depth 2 without async scheduling, stale output delivered and
dropped: a request preempted while a submitted step holds it), ``async`` (vLLM's defaults at
depths 2 and 3, stale output delivered and dropped: decodes on placeholders, a preempted request's
stale token, a request finishing while the next step holds it, a post-output registration; then
the seed's workload at depth 2, on which async scheduling registers nothing it withdraws),
``clean3`` (vLLM's defaults at depth 3), ``decisions`` (vLLM's defaults at depth 2, the
attachment's ``commit`` planted empty: the loop's record of its decisions catches it), ``ahead`` (vLLM's defaults at depth 2 with a planted bug:
``update_from_output`` registers blocks past vLLM's cap, whose last slot a submitted step still
writes), ``fuzz`` (vLLM: ``kvspec fuzz``'s machine on vLLM's
defaults under fcfs at depths 1 to 3 for a few seconds each, then under priority without async
scheduling at depth 2 until the seed bug, unshrunk: one line per cell, its preemption, depth,
runs, engine steps and finding), ``cached`` (nano: a prompt cached whole), ``preempted``
(nano: a preempted sequence left in the running queue), ``retract`` (SGLang: a decode batch that
does not fit, so SGLang retracts a request) or ``clean`` (a shared-prefix workload the engine must
handle without a finding).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kvspec.judge.spec_model as spec_model
from kvspec.conformance.check import check_file
from kvspec.conformance.trace import write_trace
from kvspec.judge import Judge
from kvspec.spec import INVARIANTS, Config


class Ones:
    """The fake model runner samples ``tokens`` in order, then always token 1 (0 would stop
    the request)."""

    def __init__(self, tokens: tuple[int, ...] = ()) -> None:
        self.tokens = list(tokens)

    def pick(self, n: int, label: str) -> int:
        return self.tokens.pop(0) if self.tokens else 1


ADAPTERS = {"vllm": "vllm_adapter", "nano": "nano_vllm_adapter", "sglang": "sglang_adapter"}


def run(
    engine: str,
    workload: list[tuple[str, tuple]],
    factory: str = "factory",
    tokens: tuple[int, ...] = (),
    plant: Callable[[Any], None] | None = None,
    compare: bool = True,
    invariants: list[str] | None = None,
    free_check: bool = True,
    env: dict[str, str] | None = None,
    **cell: object,
) -> None:
    """Judge ``workload`` on the engine's ``factory`` (``module:factory`` names one outside the
    engine's adapter module); ``compare=False`` skips the refcount and free-set comparison after
    each item, ``invariants`` limits the judge to those, ``free_check=False`` lets the spec's
    pool take an allocation of a block it does not count as free (so that the spec's own
    invariants, not the observed judge's legality check, meet the engine's reuse); ``env`` sets
    environment variables (an engine's settings) for the run; ``plant`` changes the adapter
    before the run (a planted bug)."""
    if env:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            again = (compare, invariants, free_check)
            return run(engine, workload, factory, tokens, plant, *again, **cell)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    if not free_check:
        with _unchecked_allocations():
            return run(engine, workload, factory, tokens, plant, compare, invariants, True, **cell)
    module_name, _, factory = factory.rpartition(":")
    module = importlib.import_module(
        module_name or f"kvspec.conformance.adapters.{ADAPTERS[engine]}"
    )
    cell = {"policy": "eager-unsafe", "stop_token": 0, **cell}
    config = Config(**cell)  # type: ignore[arg-type]
    adapter = getattr(module, factory)(config, Ones(tokens))
    if plant is not None:
        plant(adapter)
    observed = getattr(adapter, "judging", "strict") == "observed"
    judge = Judge.spec(adapter.config, observed, invariants)
    for what, args in workload:
        start = len(adapter.events)
        if what == "arrive":
            adapter.add_request(*args)
        elif what == "abort":
            adapter.abort(*args)
        else:
            try:
                for _ in range(args[0]):
                    adapter.step()
            except Exception as err:  # as the fuzzer reports it
                judge.feed_all(adapter.events[start:])
                print(judge.finding or f"EngineError: {type(err).__name__}: {err}")
                return
        finding = judge.feed_all(adapter.events[start:])
        if finding is None:
            finding = judge.compare(*adapter.snapshot()) if compare else judge.settle()
        check = getattr(adapter, "self_check", lambda: None)
        if finding is None and check() is not None:
            finding = check()
        if finding is not None:
            print(finding, *(["cover", *_counts(adapter)] if plant is not None else []))
            return
    kinds = sorted({str(e[0]) for e in adapter.events})
    counts = _counts(adapter)
    # The same events as a trace file, judged by `kvspec check` (observed or strict, as above).
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.jsonl"
        judging = "observed" if observed else "strict"
        write_trace(path, adapter.config, adapter.events, hashes=True, judging=judging)
        checked = check_file(path).exit_code
    print(
        "none",
        len(adapter.events),
        " ".join(kinds),
        "file",
        checked,
        *(["cover", *counts] if counts else []),
    )


def commit_loses_tokens(adapter: Any) -> None:
    """A planted bug in the attachment: every ``commit`` it derives from the runner's output
    lists no token (the loop's own record of its decisions must catch it, ``self_check``)."""
    attachment = adapter.attachment

    def stops(at: int) -> None:
        kind, step, _ = attachment.events[at]
        attachment.events[at] = (kind, step, ())

    attachment._stops = stops


def decisions_check(
    workload: list[tuple[str, tuple]], tokens: tuple[int, ...], **cell: Any
) -> None:
    """The workload on vLLM's defaults, unjudged, with and without ``commit_loses_tokens``:
    what ``self_check`` says of each (``None`` for the faithful attachment)."""
    from kvspec.conformance.adapters import vllm_adapter

    config = Config(**{"policy": "eager-unsafe", "stop_token": 0, **cell})
    said = []
    for plant in (None, commit_loses_tokens):
        adapter = vllm_adapter.factory(config, Ones(tokens))
        if plant is not None:
            plant(adapter)
        for what, args in workload:
            if what == "arrive":
                adapter.add_request(*args)
            elif what == "abort":
                adapter.abort(*args)
            else:
                for _ in range(args[0]):
                    adapter.step()
        said.append(f"{len(adapter.events)} events: {adapter.self_check()}")
    print(" | ".join(said))


def _counts(adapter: Any) -> list[str]:
    coverage = getattr(adapter, "coverage", None)
    return [] if coverage is None else [f"{k}={v}" for k, v in dataclasses.asdict(coverage).items()]


def register_ahead(adapter: Any) -> None:
    """Plant a bug in vLLM: ``update_from_output`` registers every block the request's computed
    tokens fill, without vLLM's cap at ``num_computed_tokens - num_in_flight_tokens``: the last
    slot of such a block is still to be written by a submitted step."""
    manager = adapter.scheduler.kv_cache_manager
    cache_blocks = manager.cache_blocks
    manager.cache_blocks = lambda request, _: cache_blocks(request, request.num_computed_tokens)


SEED = [  # the shrunk counterexample kvspec fuzz found in vLLM 0.33.0 (docs/adapters.md)
    ("arrive", (0, (1, 2, 3, 1, 2, 3, 1, 2, 1), 2, 1)),  # the future victim: least important
    ("step", (2,)),
    ("arrive", (1, (1,), 2, 0)),
    ("arrive", (2, (1, 2), 2, 0)),
    ("step", (3,)),  # r0 is scheduled (block 5 published), then preempted in the same step
]
CLEAN = [
    ("arrive", (0, (1, 2, 3, 4, 5, 6, 7, 8, 1), 3, 0)),
    ("arrive", (1, (1, 2, 3, 4, 5, 6, 7, 8, 2), 3, 0)),
    ("step", (3,)),
    ("arrive", (2, (1, 2, 3, 4, 9), 6, 0)),
    ("step", (30,)),
]
SEED2 = [  # the shrunk counterexample at depth 2 (docs/adapters.md); r0 and r1 sample 0 (stop)
    ("arrive", (0, (1, 2), 1, 0)),
    ("arrive", (1, (1,), 1, 0)),
    ("arrive", (2, (1, 1), 3, 1)),  # the future victim: least important
    ("step", (6,)),  # steps 0 to 3 begin, steps 0 to 1 commit: every other step is empty
    ("arrive", (3, (1, 2, 3, 1, 2, 3), 2, 0)),
    ("step", (6,)),  # step 6 publishes r2's block 3, then PRIORITY preempts r2 for r3
]
STALE = [  # depth 2: step 2 preempts r1 (fcfs: the tail) while step 1, which samples r1, runs
    ("arrive", (0, (1, 2), 3, 0)),
    ("arrive", (1, (2, 2, 1), 2, 0)),
    ("step", (30,)),
]
ASYNC = [  # vLLM's defaults, 4 blocks of 2 tokens (docs/adapters.md walks through it at depth 2)
    ("arrive", (0, (1, 2, 3), 4, 0)),
    ("arrive", (1, (2, 1), 5, 0)),
    # Step 1 decodes both on the placeholders of step 0's samples; step 2 needs a block for r0 and
    # preempts r1 (fcfs: the tail) while step 1 holds it: r1's token there is delivered. Step 2
    # samples 0 for r0 (the 5th token drawn), which finishes it while step 3 holds it; r1 resumes
    # and its last decode completes a block, registered after that step's output.
    ("step", (60,)),
]
ASYNC_TOKENS = (1, 1, 1, 1, 0)
ABORTED = [  # depth 2: step 1 decodes r0 on the placeholder of step 0's sample, then r0 is
    # aborted before step 0's output is processed: that sample is discarded, and the K/V step 1
    # writes for position 3 is of a token nobody will know. r1 shares r0's first block only.
    ("arrive", (0, (1, 2, 3), 4, 0)),
    ("step", (2,)),
    ("abort", (0,)),
    ("arrive", (1, (1, 2, 3, 1, 2), 2, 0)),
    ("step", (20,)),
]
SEED_ASYNC = [  # the seed's workload with a longer run: step 2 preempts r0 after its decode,
    # which under async scheduling runs on a placeholder and so registers nothing
    *SEED[:2],
    ("arrive", (1, (1,), 2, 0)),
    ("arrive", (2, (1, 2), 2, 0)),
    ("step", (8,)),
]
R0 = tuple(i % 7 + 1 for i in range(36))
CHUNKED = [  # docs/findings/vllm_async_chunked_prefill_zombie.py at a quarter of its sizes
    ("arrive", (0, R0, 2, 1)),  # 9 of the 9 usable blocks, least important; step 0: 16 tokens
    ("step", (1,)),
    ("arrive", (1, (9, 9, 9, 9), 4, 0)),
    # step 1: r0's chunk is capped at the threshold (8), r1 is admitted behind it; step 2 publishes
    # r0's blocks for tokens 24..32, then r1's decode needs a block and PRIORITY preempts r0
    ("step", (2,)),
    ("arrive", (2, R0[:32], 2, 0)),  # hits block 8, which no step writes
    ("step", (10,)),
]
CHUNKED_CELL = dict(
    preemption="priority", num_blocks=10, block_size=4, token_budget=16, max_running=3, depth=2
)
ASYNC_CELL = dict(preemption="fcfs", num_blocks=5, block_size=2, token_budget=6, max_running=2)

CACHED = [  # the shrunk counterexample kvspec fuzz found in nano-vllm-fork (docs/adapters.md)
    ("arrive", (0, (2, 3), 1, 0)),
    ("arrive", (1, (2, 3), 1, 0)),
    ("step", (1,)),  # r1's only block is r0's, published at allocation: nothing left to compute
]
PREEMPTED = [  # the second nano-vllm-fork finding, once prompts are never whole blocks
    ("arrive", (0, (1,), 4, 0)),
    ("arrive", (1, (1, 2, 1), 3, 0)),
    ("step", (8,)),  # step 2 preempts r1, which stays in `running`; step 3 decodes it: no blocks
]
VLLM = dict(preemption="priority", num_blocks=8, block_size=2, token_budget=6, max_running=3)
NANO = dict(discipline="general", num_blocks=8, block_size=2, token_budget=6, max_running=3)
STALE_CELL = dict(preemption="fcfs", num_blocks=4, block_size=2, token_budget=3, max_running=2)
BIG = dict(num_blocks=12, block_size=4, token_budget=16, max_running=4)


@contextmanager
def _unchecked_allocations() -> Iterator[None]:
    steer = spec_model.steer

    def unchecked(s: object, decision: object, effects: list[tuple]) -> None:
        for effect in effects:
            if effect[0] == "alloc" and effect[2] not in s.free:  # type: ignore[attr-defined]
                s.free.append(effect[2])  # type: ignore[attr-defined]
        steer(s, decision, effects)

    spec_model.steer = unchecked  # type: ignore[assignment]
    try:
        yield
    finally:
        spec_model.steer = steer


SGLANG = dict(policy="engine-registers", discipline="general")
SMALL = dict(num_blocks=8, block_size=2, token_budget=6, max_running=2)
DECAYED = {"SGLANG_INIT_NEW_TOKEN_RATIO": "0.098", "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "1"}
"""SGLang's new-token ratio where a long-running server has it: it starts at 0.7 and decays to its
minimum, 0.7 x 0.14 = 0.098, over 600 decode steps (far more than one fuzzed example runs), so
admission reserves little for decoding and decodes can run out of pages (retraction)."""
RETRACT = [  # four requests in 7 pages of 2 tokens, admitted on the new-token ratio a long-running
    # SGLang has decayed to (SGLANG_INIT_NEW_TOKEN_RATIO below): their decodes run out of pages
    ("arrive", (0, (2, 2), 6, 0)),
    ("step", (1,)),
    ("arrive", (1, (2, 1), 6, 0)),
    ("arrive", (2, (2, 2, 2), 4, 0)),
    ("step", (1,)),
    ("arrive", (3, (2, 1, 1, 1, 2, 2), 4, 0)),
    ("step", (43,)),
]
KNOWN = [  # r0's prefill result is processed after step 1, which admits r1 and does not decode r0
    ("arrive", (0, (1, 2, 3), 3, 0)),
    ("step", (1,)),
    ("arrive", (1, (3, 3), 2, 0)),
    ("step", (1,)),  # forms step 1, then processes step 0: r0 is inserted
    ("arrive", (2, (1, 2, 3, 1, 2), 2, 0)),  # r0's prompt and its first token, then more
    ("step", (30,)),  # step 2 admits r2 on r0's pages before anything writes r0's token 3
]
KNOWN_DECODED = [  # the same without r1: step 1 decodes r0, so its token 3 is being written
    ("arrive", (0, (1, 2, 3), 3, 0)),
    ("step", (2,)),
    ("arrive", (2, (1, 2, 3, 1, 2), 2, 0)),
    ("step", (30,)),
]
DEDUP = [  # r2 recomputes r0's cached page (a match leaves the last token); when its result is
    # processed SGLang inserts it onto r0's page and frees r2's copy, which step 4, decoding r2 on
    # the token step 3 samples, still reads; step 5 decodes r1 and r2 again
    ("arrive", (0, (3, 1), 1, 0)),
    ("step", (2,)),
    ("arrive", (1, (2, 2, 2), 5, 0)),
    ("step", (1,)),
    ("arrive", (2, (3, 1), 3, 0)),
    ("step", (3,)),
    ("step", (30,)),
]
CONCURRENT = [  # three short requests decoding together in 11 pages of 4 tokens: room to spare
    ("arrive", (0, (1, 2), 6, 0)),
    ("arrive", (1, (2, 1), 6, 0)),
    ("arrive", (2, (3, 3, 1), 6, 0)),
    ("step", (40,)),
]
DEDUP_CELL = dict(SGLANG, num_blocks=9, block_size=2, token_budget=3, max_running=3, depth=2)
ROOMY = dict(SGLANG, num_blocks=12, block_size=2, token_budget=6, max_running=3, depth=2)
MUTANTS = "kvspec.conformance.adapters.sglang_adapter.mutants"
UNWRITTEN = ("NoUnwrittenRead", "NoUnwrittenPublish")
SGLANG_CASES: dict[str, tuple[list[tuple[str, tuple]], str, dict[str, object]]] = {
    # case: (workload, factory, cell and judge options); overlap cells at depth 2
    "clean": (CLEAN, "factory", dict(SGLANG, **BIG, depth=2)),
    "sync": (CLEAN, "sync_factory", dict(SGLANG, **BIG)),
    "retract": (RETRACT, "factory", dict(SGLANG, **SMALL, depth=2, env=DECAYED)),
    "retract-sync": (RETRACT, "sync_factory", dict(SGLANG, **SMALL, env=DECAYED)),
    "dedup": (DEDUP, "factory", DEDUP_CELL),
    "known": (KNOWN, f"{MUTANTS}:insert_known_factory", ROOMY),
    "known-read": (
        KNOWN,
        f"{MUTANTS}:insert_known_factory",
        dict(ROOMY, invariants=["NoUnwrittenRead"]),
    ),
    "known-none": (
        KNOWN,
        f"{MUTANTS}:insert_known_factory",
        dict(
            ROOMY,
            invariants=[i for i in INVARIANTS if i not in UNWRITTEN + ("SharedImpliesSamePrefix",)],
        ),
    ),
    "known-off": (KNOWN, "factory", ROOMY),
    "known-decoded": (KNOWN_DECODED, f"{MUTANTS}:insert_known_factory", ROOMY),
    "late": (DEDUP, f"{MUTANTS}:late_repoint_factory", DEDUP_CELL),
    "late-reuse": (DEDUP, f"{MUTANTS}:late_repoint_factory", dict(DEDUP_CELL, compare=False)),
    "late-read": (
        DEDUP,
        f"{MUTANTS}:late_repoint_factory",
        dict(DEDUP_CELL, compare=False, free_check=False, invariants=["NoUnwrittenRead"]),
    ),
    "late-off": (DEDUP, "factory", DEDUP_CELL),
    # the same cells on the tree caches SGLang does not build by default (build.TREES)
    "clean-legacy": (CLEAN, "legacy_factory", dict(SGLANG, **BIG, depth=2)),
    "sync-legacy": (CLEAN, "legacy_sync_factory", dict(SGLANG, **BIG)),
    "retract-legacy": (RETRACT, "legacy_factory", dict(SGLANG, **SMALL, depth=2, env=DECAYED)),
    "dedup-legacy": (DEDUP, "legacy_factory", DEDUP_CELL),
    "clean-python": (CLEAN, "python_core_factory", dict(SGLANG, **BIG, depth=2)),
    "retract-test": (CONCURRENT, "retract_factory", dict(SGLANG, **BIG, depth=2)),
    "retract-test-off": (CONCURRENT, "factory", dict(SGLANG, **BIG, depth=2)),
    "retract-python": (
        RETRACT,
        "python_core_factory",
        dict(SGLANG, **SMALL, depth=2, env=DECAYED),
    ),
}
"""``clean``/``sync``: a shared-prefix workload (two requests computing the same prefix in one
step, a later one hitting it); ``retract*``: decodes that run out of pages; ``dedup``: SGLang's
dedup while the next step reads the copy; ``known*``: the ``InsertKnown`` mutant (judged with
all invariants, with NoUnwrittenRead alone, with neither it nor NoUnwrittenPublish), SGLang's own
order on the same workload, and the mutant where the launched step writes what it inserts;
``late*``: the ``LateRepoint`` mutant (judged in full; without the refcount comparison; also
and without the legality check of allocations, NoUnwrittenRead alone) and SGLang's order on the
same workload; ``retract-test``: three requests decoding together with pages to spare, in SGLang's
retraction test mode (``retract-test-off``: the same without it);
``*-legacy``, ``*-python``: the legacy ``RadixCache`` and ``UnifiedRadixCache`` over
SGLang's Python ``TreeCore`` (the default is its Rust one)."""


def sglang_tree() -> None:
    """The tree cache each SGLang factory builds: its class, components and ``TreeCore``."""
    from kvspec.conformance.adapters import sglang_adapter
    from kvspec.conformance.adapters.sglang_adapter.build import core_backend

    config = Config(**SGLANG, **SMALL, stop_token=0)  # type: ignore[arg-type]
    said = []
    for name in ("factory", "sync_factory", "python_core_factory", "legacy_factory"):
        cell = config if name == "sync_factory" else dataclasses.replace(config, depth=2)
        tree = getattr(sglang_adapter, name)(cell, Ones()).scheduler.tree
        parts = sorted(str(c) for c in getattr(tree, "components", {}))
        said.append(f"{name} {type(tree).__name__} {'+'.join(parts) or '-'} {core_backend(tree)}")
    print(" | ".join(said))


def sglang_refusals() -> None:
    """What the SGLang factory says of the cells its tree cache cannot run: one line each."""
    from kvspec.conformance.adapters import sglang_adapter

    said = []
    for extra in (dict(sliding_window=4), dict(spec_tokens=2)):
        config = Config(**SGLANG, **SMALL, depth=2, stop_token=0, **extra)  # type: ignore[arg-type]
        try:
            sglang_adapter.factory(config, Ones())
            said.append(f"{extra}: built")
        except ValueError as refusal:
            said.append(f"{extra}: {refusal}")
    print(" | ".join(said))


def leak_first_unlock(adapter: Any) -> None:
    """Plant a bug in SGLang's tree: the ``unlock`` of the first request released at its finish
    (``release_kv_cache``) is lost, so its pages stay locked (unevictable) after it is gone."""
    tree, record = adapter.scheduler.tree, adapter.scheduler.record
    unlock = tree.unlock

    def unlock_(lock: Any) -> None:
        if lock is not None and record.finishing and not getattr(tree, "leaked", False):
            tree.leaked = True
            return
        unlock(lock)

    tree.unlock = unlock_


SGLANG_PLANTED = {
    # case: (workload, factory, plant, cell): a lost unlock, on each tree cache
    "leak": (CLEAN, "factory", leak_first_unlock, dict(SGLANG, **BIG, depth=2)),
    "leak-python": (CLEAN, "python_core_factory", leak_first_unlock, dict(SGLANG, **BIG, depth=2)),
    "leak-legacy": (CLEAN, "legacy_factory", leak_first_unlock, dict(SGLANG, **BIG, depth=2)),
}


def kvspec(*argv: str) -> None:
    """``kvspec ARGV`` in this process (the engine is imported once): one line with its exit
    code, whether stderr holds a traceback, and its output's lines joined by `` | `` (and, when
    it exits non-zero, the last line of stderr)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from kvspec.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
    lines = out.getvalue().splitlines()
    if code:  # the one line of a refusal (an engine's import chatter otherwise)
        lines += err.getvalue().strip().splitlines()[-1:]
    print("exit", code, "traceback" in err.getvalue().lower(), " | ".join(lines))


OVERLAP_TARGET = "kvspec.conformance.adapters.sglang_adapter:factory"
SGLANG_CELL = ("--policy", "engine-registers", "--discipline", "general")
RETRACT_TARGET = "kvspec.conformance.adapters.sglang_adapter:retract_factory"
KEEPS_LOCK = f"{MUTANTS}:retract_keeps_lock_retract_factory"
SGLANG_KVSPEC = {
    "fuzz": ("fuzz", "--target", OVERLAP_TARGET, *SGLANG_CELL, "--depth", "2", "--seconds", "10"),
    "fuzz-retract": (
        "fuzz",
        "--target",
        RETRACT_TARGET,
        *SGLANG_CELL,
        "--depth",
        "2",
        "--seconds",
        "15",
    ),
    "keeps-lock": (
        "fuzz",
        "--target",
        KEEPS_LOCK,
        *SGLANG_CELL,
        "--depth",
        "2",
        "--seconds",
        "30",
    ),
    "refused": ("fuzz", "--target", OVERLAP_TARGET, *SGLANG_CELL, "--depth", "1", "--seconds", "1"),
}
"""``fuzz``: 10 s of ``kvspec fuzz`` on the overlap loop (seed 0); ``fuzz-retract``: 15 s on it
in SGLang's retraction test mode (``retract_factory``); ``keeps-lock``: up to 30 s on that with
a planted retraction bug (``mutants.RetractKeepsLock``); ``refused``: the overlap factory at
depth 1, bad input."""


def fuzz_vllm() -> None:
    from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
    from hypothesis.stateful import get_state_machine_test

    from kvspec.conformance.adapters import vllm_adapter
    from kvspec.conformance.fuzz import CounterexampleFound, lockstep_machine, run_cell

    # warm-up, not counted: the first example pays for vLLM's lazy imports and first configs,
    # which on a loaded machine took most of the first cell's 6 s
    run_cell("eager-unsafe", "vllm", "fcfs", 1, seconds=1, factory=vllm_adapter.factory)
    for depth in (1, 2, 3):
        r = run_cell("eager-unsafe", "vllm", "fcfs", depth, seconds=6, factory=vllm_adapter.factory)
        print("fcfs", depth, r.runs, r.commits, r.failure.finding.invariant if r.failure else None)
    machine = lockstep_machine(
        "eager-unsafe", "vllm", "priority", 2, factory=vllm_adapter.sync_factory
    )
    generate = settings(  # as run_cell, without shrinking: finding it is what takes little time
        max_examples=25,
        stateful_step_count=40,
        deadline=None,
        database=None,
        verbosity=Verbosity.quiet,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    tally = machine.tally  # type: ignore[attr-defined]
    for batch in range(200):
        try:
            seed(batch)(get_state_machine_test(machine, settings=generate))()
        except CounterexampleFound:
            break
    finding = tally.failure.finding.invariant if tally.failure else None
    print("priority", 2, tally.runs, tally.commits, finding)


if __name__ == "__main__":
    engine = sys.argv[1]
    for case in sys.argv[2:]:  # one line each, in one process (vLLM takes seconds to import)
        if engine == "sglang" and case in SGLANG_KVSPEC:
            kvspec(*SGLANG_KVSPEC[case], "--seed", "0")
        elif engine == "sglang" and case == "tree":
            sglang_tree()
        elif engine == "sglang" and case == "refusals":
            sglang_refusals()
        elif engine == "sglang" and case in SGLANG_PLANTED:
            workload, factory, plant, options = SGLANG_PLANTED[case]
            run(engine, workload, factory, plant=plant, **options)  # type: ignore[arg-type]
        elif engine == "sglang":
            workload, factory, options = SGLANG_CASES[case]
            run(engine, workload, factory, **options)  # type: ignore[arg-type]
        elif case == "seed":
            run(engine, SEED, **VLLM)
        elif case == "seed2":
            cell = dict(VLLM, num_blocks=6, token_budget=5, max_running=2, depth=2)
            run(engine, SEED2, "sync_factory", tokens=(0, 0), **cell)
        elif case == "stale":  # without async scheduling, stale output delivered and dropped
            for factory in ("sync_factory", "drop_factory"):
                run(engine, STALE, factory, **dict(STALE_CELL, depth=2))
        elif case == "async":  # vLLM's defaults and their drop mode, depths 2 and 3
            for factory in ("factory", "async_drop_factory"):
                for depth in (2, 3):
                    run(engine, ASYNC, factory, ASYNC_TOKENS, **dict(ASYNC_CELL, depth=depth))
            run(engine, ABORTED, **dict(ASYNC_CELL, depth=2))
            run(engine, SEED_ASYNC, **dict(VLLM, depth=2))
        elif case == "ahead":  # vLLM's defaults at depth 2, its post-output cap planted away
            run(engine, ASYNC, "factory", ASYNC_TOKENS, register_ahead, **dict(ASYNC_CELL, depth=2))
        elif case == "chunked":  # the threshold on (the finding), then vLLM's default 0
            for factory in ("long_prefill_factory", "factory"):
                run(engine, CHUNKED, factory, **CHUNKED_CELL)
        elif case == "decisions":  # the attachment's commit planted empty, vLLM's defaults
            decisions_check(ASYNC, ASYNC_TOKENS, **dict(ASYNC_CELL, depth=2))
        elif case == "clean3":  # vLLM's defaults at depth 3
            run(engine, CLEAN, preemption="fcfs", depth=3, **BIG)
        elif case == "fuzz":
            fuzz_vllm()
        elif case == "cached":
            run(engine, CACHED, **NANO)
        elif case == "preempted":
            run(engine, PREEMPTED, **dict(NANO, num_blocks=4))
        elif engine == "vllm":
            run(engine, CLEAN, preemption="fcfs", **BIG)
        else:
            run(engine, CLEAN, discipline="general", **BIG)
