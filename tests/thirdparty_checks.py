"""Fixed workloads on a third-party engine, judged event by event; run inside that engine's venv
by ``tests/test_adapter_vllm.py`` and ``tests/test_adapter_nano.py``.

``python tests/thirdparty_checks.py ENGINE CASE...`` prints, per case, the first finding, or
``none`` with the number of events, their kinds, ``file`` and the exit code of ``kvspec check``
on the same events written as a trace file (and, for vLLM, how many stale outputs of preempted
requests came back). ENGINE is ``vllm``, ``nano`` or ``sglang``; CASE is ``seed``
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
import sys
import tempfile
from pathlib import Path

from kvspec.conformance.check import check_file
from kvspec.conformance.judge import Judge
from kvspec.conformance.trace import write_trace
from kvspec.spec import Config


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
    **cell: object,
) -> None:
    module = importlib.import_module(f"kvspec.conformance.adapters.{ADAPTERS[engine]}")
    cell = {"policy": "eager-unsafe", "stop_token": 0, **cell}
    config = Config(**cell)  # type: ignore[arg-type]
    adapter = getattr(module, factory)(config, Ones(tokens))
    observed = getattr(adapter, "judging", "strict") == "observed"
    judge = Judge.spec(adapter.config, observed)
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
            finding = judge.compare(*adapter.snapshot())
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
SGLANG = dict(policy="engine-registers", discipline="general")
RETRACT = [  # three requests in 7 pages of 2 tokens: admitted on SGLang's estimate (70% of their
    # remaining tokens), their decode batch runs out of pages and SGLang retracts one
    ("arrive", (0, (2, 2, 1, 1, 3, 3, 2, 3), 3, 0)),
    ("arrive", (1, (3, 1, 3, 1, 2, 1), 3, 0)),
    ("arrive", (2, (2, 2, 1, 1, 1), 3, 0)),
    ("step", (60,)),
]

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
        elif case == "retract":
            run(
                engine, RETRACT, **SGLANG, num_blocks=8, block_size=2, token_budget=6, max_running=4
            )
        elif engine == "sglang":
            run(engine, CLEAN, **SGLANG, **BIG)
        elif engine == "vllm":
            run(engine, CLEAN, preemption="fcfs", **BIG)
        else:
            run(engine, CLEAN, discipline="general", **BIG)
