"""Fixed workloads on a third-party engine, judged event by event; run inside that engine's venv
by ``tests/test_adapter_vllm.py``, ``tests/test_adapter_nano.py`` and ``tests/test_adapter_sglang.py``.

``python tests/thirdparty_checks.py ENGINE CASE...`` prints, per case, the first finding, or
``none`` with the number of events, their kinds, ``file`` and the exit code of ``kvspec check``
on the same events written as a trace file (and, for vLLM, how many stale outputs of preempted
requests came back). ENGINE is ``vllm``, ``nano`` or ``sglang`` (its cases: ``SGLANG_CASES``, and
``SGLANG_KVSPEC``: ``kvspec`` commands run in the same process); CASE is ``seed``
(vLLM: the seed bug's shrunk counterexample), ``seed2`` (the same bug with a batch queue of 2
steps), ``stale`` (vLLM at depth 2, default and drop mode: a request preempted while a submitted
step holds it), ``clean3`` (vLLM's drop mode at depth 3), ``async`` (vLLM's async scheduling,
whose first decode is scheduled before its token is known, which the spec refuses), ``cached``
(nano: a prompt cached whole), ``preempted`` (nano: a preempted sequence left in the running
queue), ``retract`` (SGLang: a decode batch that does not fit, so SGLang retracts a request) or
``clean`` (a shared-prefix workload the engine must handle without a finding).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kvspec.conformance.judge.spec_model as spec_model
from kvspec.conformance.check import check_file
from kvspec.conformance.judge import Judge
from kvspec.conformance.trace import write_trace
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
    environment variables (an engine's settings) for the run."""
    if env:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return run(engine, workload, factory, tokens, compare, invariants, free_check, **cell)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    if not free_check:
        with _unchecked_allocations():
            return run(engine, workload, factory, tokens, compare, invariants, True, **cell)
    module_name, _, factory = factory.rpartition(":")
    module = importlib.import_module(
        module_name or f"kvspec.conformance.adapters.{ADAPTERS[engine]}"
    )
    cell = {"policy": "eager-unsafe", "stop_token": 0, **cell}
    config = Config(**cell)  # type: ignore[arg-type]
    adapter = getattr(module, factory)(config, Ones(tokens))
    observed = getattr(adapter, "judging", "strict") == "observed"
    judge = Judge.spec(adapter.config, observed, invariants)
    for what, args in workload:
        start = len(adapter.events)
        if what == "arrive":
            adapter.add_request(*args)
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
            print(finding)
            return
    kinds = sorted({str(e[0]) for e in adapter.events})
    stale = getattr(adapter, "stale_outputs", 0)
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
        *(["stale", stale] if stale else []),
    )


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
}
"""``clean``/``sync``: a shared-prefix workload (two requests computing the same prefix in one
step, a later one hitting it); ``retract*``: decodes that run out of pages; ``dedup``: SGLang's
dedup while the next step reads the copy; ``known*``: the ``InsertKnown`` mutant (judged with
all invariants, with NoUnwrittenRead alone, with neither it nor NoUnwrittenPublish), SGLang's own
order on the same workload, and the mutant where the launched step writes what it inserts;
``late*``: the ``LateRepoint`` mutant (judged in full; without the refcount comparison; also
and without the legality check of allocations, NoUnwrittenRead alone) and SGLang's order on the
same workload."""


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
SGLANG_KVSPEC = {
    "fuzz": ("fuzz", "--target", OVERLAP_TARGET, *SGLANG_CELL, "--depth", "2", "--seconds", "10"),
    "refused": ("fuzz", "--target", OVERLAP_TARGET, *SGLANG_CELL, "--depth", "1", "--seconds", "1"),
}
"""``fuzz``: 10 s of ``kvspec fuzz`` on the overlap loop (seed 0); ``refused``: the overlap
factory at depth 1, bad input."""

if __name__ == "__main__":
    engine = sys.argv[1]
    for case in sys.argv[2:]:  # one line each, in one process (vLLM takes seconds to import)
        if case == "seed":
            run(engine, SEED, **VLLM)
        elif case == "seed2":
            cell = dict(VLLM, num_blocks=6, token_budget=5, max_running=2, depth=2)
            run(engine, SEED2, tokens=(0, 0), **cell)
        elif case == "stale":  # vLLM's default and its drop mode, both at depth 2
            for factory in ("factory", "drop_factory"):
                run(engine, STALE, factory, **dict(STALE_CELL, depth=2))
        elif case == "async":  # AsyncScheduler: the spec cannot judge its placeholder decodes
            run(engine, CLEAN, "async_factory", preemption="fcfs", depth=2, **BIG)
        elif case == "clean3":  # depth 3: vLLM's drop mode (the module docstring says why)
            run(engine, CLEAN, "drop_factory", preemption="fcfs", depth=3, **BIG)
        elif case == "cached":
            run(engine, CACHED, **NANO)
        elif case == "preempted":
            run(engine, PREEMPTED, **dict(NANO, num_blocks=4))
        elif engine == "sglang" and case in SGLANG_KVSPEC:
            kvspec(*SGLANG_KVSPEC[case], "--seed", "0")
        elif engine == "sglang":
            workload, factory, options = SGLANG_CASES[case]
            run(engine, workload, factory, **options)  # type: ignore[arg-type]
        elif engine == "vllm":
            run(engine, CLEAN, preemption="fcfs", **BIG)
        else:
            run(engine, CLEAN, discipline="general", **BIG)
