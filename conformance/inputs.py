"""Inputs that are not regular files, read as files: ``-`` (standard input), ``/dev/stdin``, a
named pipe, a shell's ``<(...)``.

The checker reads a trace by seeking in it (a finding's report is made by judging again from a
checkpoint, ``judge/handover.py``), which a pipe cannot do. ``seekable`` copies such a stream,
in chunks, into a temporary file that lives as long as the ``with`` block, and gives its path;
a regular file's path is given as it is. ``relabel`` puts the name the user gave back into a
report made from the copy. A folder, or a path that cannot be opened, is one line naming it
(``ValueError``/``OSError``: exit 2).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from .report import Report

STDIN = "-"
"""The name that stands for standard input."""

CHUNK = 1 << 20
"""Bytes copied at a time from a stream."""


@contextlib.contextmanager
def seekable(path: str) -> Iterator[str]:
    """``path`` itself when it is a regular file; for a stream, the path of a temporary copy
    (removed at the end)."""
    if path != STDIN:
        try:
            mode = os.stat(path).st_mode
        except OSError as err:
            raise OSError(f"{path}: {err.strerror or err}") from None
        if stat.S_ISDIR(mode):
            raise ValueError(f"{path}: a folder, not a trace file")
        if stat.S_ISREG(mode):
            yield path
            return
    with contextlib.ExitStack() as stack:
        source: BinaryIO = (
            sys.stdin.buffer if path == STDIN else stack.enter_context(open(path, "rb"))
        )  # noqa: SIM115
        copy = stack.enter_context(
            tempfile.NamedTemporaryFile(prefix="kvspec-stdin-", suffix=".jsonl")
        )
        shutil.copyfileobj(source, copy, CHUNK)
        copy.flush()
        yield copy.name


def name_of(path: str) -> str:
    """How a report names ``path``: ``<stdin>`` for ``-``."""
    return "<stdin>" if path == STDIN else path


def relabel(report: Report, real: str, path: str) -> Report:
    """``report`` of the copy ``real`` as the report of ``path``."""
    if real == path:
        return report
    name = name_of(path)
    report.path = name
    if report.error:
        report.error = report.error.replace(real, name)
    return report


def is_stream(path: str) -> bool:
    """Whether ``path`` is ``-`` or something other than a regular file (read once only)."""
    if path == STDIN:
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def same_file(a: str, b: str) -> bool:
    """Whether writing ``b`` would overwrite the input ``a`` (the same file, or the same path)."""
    if a == STDIN:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
