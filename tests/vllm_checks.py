"""Checks that run inside .venv-vllm (``tests/test_adapter_vllm.py`` runs this file there).

``python tests/vllm_checks.py seed``: the seed scenario's workload on vLLM's real scheduler under
priority preemption, judged event by event; prints the finding (or ``none``).
``python tests/vllm_checks.py clean``: a shared-prefix workload under fcfs; prints the finding or
``none``, and the event counts.
"""

from __future__ import annotations

import sys

from kvspec.conformance.adapters.vllm_adapter import factory
from kvspec.conformance.lockstep import Judge
from kvspec.spec import Config


class Ones:
    """The fake model runner always samples token 1 (0 would stop the request)."""

    def pick(self, n: int, label: str) -> int:
        return 1


def run(preemption: str, workload: list[tuple[str, tuple]], **geometry: int) -> None:
    config = Config(policy="eager-unsafe", preemption=preemption, stop_token=0, **geometry)
    adapter = factory(config, Ones())
    judge = Judge(config)
    for what, args in workload:
        start = len(adapter.events)
        if what == "arrive":
            adapter.add_request(*args)
        else:
            for _ in range(args[0]):
                adapter.step()
        finding = judge.feed_all(adapter.events[start:])
        if finding is None:
            finding = judge.compare(*adapter.snapshot())
        if finding is None and adapter.self_check() is not None:
            finding = adapter.self_check()
        if finding is not None:
            print(finding)
            return
    kinds = sorted({str(e[0]) for e in adapter.events})
    print("none", len(adapter.events), " ".join(kinds))


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

if __name__ == "__main__":
    if sys.argv[1] == "seed":
        run("priority", SEED, num_blocks=8, block_size=2, token_budget=6, max_running=3)
    else:
        run("fcfs", CLEAN, num_blocks=12, block_size=4, token_budget=16, max_running=4)
