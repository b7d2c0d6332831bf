"""A costly result computed once per test run and shared by pytest-xdist's workers: ``once(name,
compute)`` returns ``compute()``'s JSON-able result, computed by the first worker that asks and
read from a file by the others (a file lock per name; the others wait meanwhile, so the CPU is
spent once where under ``-n 2`` it was spent by both workers).

Why not ``--dist loadgroup`` and ``xdist_group`` marks: under pytest 9.2 with pytest-xdist 3.8
they do nothing (xdist renames the items through ``item._nodeid``, which pytest 9 no longer reads
for ``item.nodeid``: the group suffix never reaches the scheduler; checked on a two-file example,
each group's tests ran on both workers), and a lock holds under any ``-n`` and ``--dist``.

The folder is the run's (``PYTEST_XDIST_TESTRUNUID``, the same in every worker of one run); a
plain ``pytest`` run computes in place. A module-scoped fixture joins by wrapping its body:
``return once("NAME", lambda: ...)``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock


def once(name: str, compute: Callable[[], Any]) -> Any:
    """``compute()``, once per test run across xdist workers (its result must be JSON-able)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return compute()
    folder = Path(tempfile.gettempdir()) / f"kvspec-run-once-{run}"
    folder.mkdir(exist_ok=True)
    result = folder / f"{name}.json"
    with FileLock(str(folder / f"{name}.lock")):
        if not result.exists():
            value = compute()
            partial = result.with_suffix(".partial")
            partial.write_text(json.dumps(value))
            partial.replace(result)
    return json.loads(result.read_text())
