"""The command line's outputs: paths checked before any work, and a stdout a closed pipe cannot break.

``output_path`` is the argparse type of every option that names a file kvspec writes (``--out``,
``--html``, ``--witness``): a path whose folder is missing or not writable, or that is a folder, is
refused while the arguments are parsed (exit 2), not after minutes of fuzzing.

``reader_safe_stdout`` makes a closed pipe harmless: ``kvspec check t | head -1`` reads one line
and closes the pipe; the next write would raise ``BrokenPipeError`` (or the interpreter's last
flush would, exit 120). Under it, once the reader has gone, stdout goes to ``os.devnull`` and the
command runs to its verdict, whose exit code stands.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import TextIO


def output_path(text: str) -> str:
    """An argparse ``type``: ``text`` if a file can be written there, else why not."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {folder} is not writable")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: the file is not writable")
    return text


class _ReaderSafe:
    """A text stream that stops writing, without an error, once its reader has gone."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        """Point the descriptor at /dev/null, so that the data still buffered (and the
        interpreter's last flush) go nowhere, quietly."""
        self.reader_gone = True
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)


@contextlib.contextmanager
def reader_safe_stdout() -> Iterator[_ReaderSafe]:
    """``sys.stdout`` made safe for the duration (flushed at the end, quietly)."""
    original = sys.stdout
    safe = _ReaderSafe(original)
    sys.stdout = safe  # type: ignore[assignment]
    try:
        yield safe
    finally:
        safe.flush()
        sys.stdout = original
