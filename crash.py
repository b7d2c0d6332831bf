"""Crash reports: what kvspec keeps when it fails inside itself (exit 4), and the cache folder.

An internal error of kvspec (an exception that is not about the input) is never reported as a
finding (exit 1) and never as a traceback on the user's terminal: ``kvspec`` prints one line
naming a report file and exits 4. The report holds what a bug report needs: the traceback,
kvspec's version, the command line, the Python version and the platform.

Reports, and everything else kvspec keeps between runs (the fuzzer's Hypothesis folder), go to
the user cache folder (``platformdirs``: ``$XDG_CACHE_HOME/kvspec`` or ``~/.cache/kvspec`` on
Linux), or ``KVSPEC_CACHE_DIR`` when set; a report that cannot be written there goes to the
temporary folder.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

ENV = "KVSPEC_CACHE_DIR"


def cache_dir() -> Path:
    """kvspec's user cache folder (not created here)."""
    override = os.environ.get(ENV)
    if override:
        return Path(override)
    try:
        import platformdirs
    except ImportError:  # kvspec installed without its dependencies: the XDG folder
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvspec"
    return Path(platformdirs.user_cache_dir("kvspec", appauthor=False))


def save_report(error: BaseException, argv: Sequence[str]) -> Path:
    """Write a crash report for ``error`` and return its path (the cache folder, else the
    temporary folder)."""
    from kvspec import __version__

    stamp = time.strftime("%Y%m%d-%H%M%S")
    text = "".join(
        [
            f"kvspec {__version__} crashed (an internal error of kvspec, not of the input)\n",
            f"command: kvspec {' '.join(argv)}\n",
            f"python: {sys.version.split()[0]} ({sys.executable})\n",
            f"platform: {platform.platform()}\n",
            f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n\n",
            *traceback.format_exception(type(error), error, error.__traceback__),
            *([f"\n{error.details}\n"] if isinstance(getattr(error, "details", None), str) else []),
        ]
    )
    last: OSError | None = None
    for folder in (cache_dir(), Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"crash-{stamp}-{os.getpid()}.txt"
            path.write_text(text, encoding="utf-8")
            return path
        except OSError as err:
            last = err
    raise OSError(f"no folder to write a crash report to ({last})")
