"""vLLM's ``hybrid.swa_factory`` on requests of the fuzzer's sizes (blocks of 2 tokens, at most
three per group; a pool of 12 blocks, so that neither is preempted): two requests share a prompt's first block,
the second decodes past its one-block window, and the coverage counters
(``fuzz_coverage.RunCoverage``) read off the engine's events count a window block nulled while
the request shared another group's block (with a two-block window, none: ``python
tests/vllm_swa_window_checks.py 2`` sets ``hybrid.WINDOW_BLOCKS`` so). Run inside each vLLM venv by
``tests/test_vllm_swa_window.py``; prints the counter and the judge's finding (``none``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from thirdparty_checks import Ones  # noqa: E402

from kvspec.conformance.adapters.vllm_adapter import hybrid  # noqa: E402
from kvspec.conformance.fuzz import coverage_of  # noqa: E402
from kvspec.judge import Judge  # noqa: E402
from kvspec.spec import Config  # noqa: E402

CELL = dict(num_blocks=12, block_size=2, token_budget=8, max_running=2, policy="eager-unsafe")


def main() -> None:
    config = Config(**CELL, depth=1, stop_token=0)  # type: ignore[arg-type]
    adapter = hybrid.swa_factory(config, Ones())
    judge = Judge.spec(adapter.config, False)
    coverage = coverage_of(adapter.config)
    adapter.add_request(0, (1, 2, 3), 3, 0, False)
    for _ in range(2):
        adapter.step()
    adapter.add_request(1, (1, 2, 4), 2, 0, False)
    for _ in range(12):
        adapter.step()
    coverage.observe(adapter.events)
    finding = judge.feed_all(adapter.events)
    said = "none" if finding is None else f"{finding.invariant}: {finding.message}"
    print(f"window_nulled_shared {coverage.window_nulled_shared} | finding {said}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        hybrid.WINDOW_BLOCKS = int(sys.argv[1])
    main()
