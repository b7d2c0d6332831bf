"""Nondeterministic decisions: every choice the engine makes goes through ``Choices.pick``.

Labels (``pick(n, label)`` returns an int in ``[0, n)``; it is asked only when ``n >= 2``):

==================  =====================================================================
label               meaning of the answer
==================  =====================================================================
``load-fails``      per external-load entry of an executed step, in scheduling order:
                    1 = the load fails, 0 = it succeeds
``general-action``  general discipline, next move among the available ones, in this order:
                    run the next running request, admit a waiting request, submit the
                    step, preempt a running request (unavailable moves are left out)
``general-admit``   general discipline: which waiting request to admit, in admission order,
                    leaving out those scheduled or refused in this step and those
                    still waiting for their stale output (delivered mode)
``drafts``          speculative decoding, after a running request samples: K minus the
                    number of draft tokens its drafter proposes for its next decode
``rejected``        speculative decoding, per request with d draft tokens in a committed
                    step: how many of them the model rejects (0 .. d; the last ones)
``general-victim``  general discipline: a victim. For the preempt move: index into
                    ``running``. When a running request lacks blocks: index into the other
                    running requests tail first, the last option skipping the request.
                    When an admission lacks blocks: 0 skips it, k preempts the k-th
                    running request counted from the tail.
==================  =====================================================================

``DefaultChoices`` always answers 0, which gives a deterministic engine that makes progress.
"""

from __future__ import annotations

import random
from typing import Protocol


class Choices(Protocol):
    def pick(self, n: int, label: str) -> int:
        """An int in ``[0, n)`` for the decision named ``label``."""
        ...


class DefaultChoices:
    """Always the first option: no load fails, the vLLM-like move is always taken."""

    __slots__ = ()

    def pick(self, n: int, label: str) -> int:
        return 0


class RandomChoices:
    """Seeded random choices; a load fails with probability ``fail_rate``."""

    __slots__ = ("fail_rate", "rng")

    def __init__(self, seed: int, fail_rate: float = 0.0) -> None:
        if not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], got {fail_rate!r}")
        self.rng = random.Random(seed)
        self.fail_rate = fail_rate

    def pick(self, n: int, label: str) -> int:
        if label == "load-fails":
            return 1 if self.rng.random() < self.fail_rate else 0
        return self.rng.randrange(n)
