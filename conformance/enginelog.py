"""Third-party engines' own log output, silenced while kvspec drives them (``--engine-log`` shows it).

vLLM and SGLang log through Python's ``logging`` (vLLM configures its own handler at import and
prints a few lines for every engine it builds, that is, for every fuzzed example) and warn through
``warnings``; fuzzing builds hundreds of engines, and their lines bury kvspec's own output.
``engine_logs(shown=False)`` disables every logging record and filters every warning for the
duration (kvspec itself logs nothing); the previous settings come back on exit.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def engine_logs(shown: bool = False) -> Iterator[None]:
    if shown:
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
