"""A GGUF model converted once and kept on disk: its float32 tensors (safetensors) and config, and
its tokenizer (a saved transformers folder), under the digest of the GGUF file's bytes.

Reading a GGUF file is slow where it should not matter: ``GGUFReader`` parses every metadata field
(the whole vocabulary) element by element, the quantized tensors are expanded in numpy, and
transformers rebuilds the tokenizer from the vocabulary. A second ``kvspec generate`` (or test)
on the same file then reads the converted copy instead.

Where: ``models/`` in kvspec's cache folder (``kvspec.crash.cache_dir``: ``$KVSPEC_CACHE_DIR``,
else the user cache folder), or ``$KVSPEC_MODEL_CACHE`` if set (``off`` turns the cache off). The
key is the file's BLAKE2b digest plus ``FORMAT`` (bumped whenever what is stored changes), so an
edited or replaced file, or a new conversion, never reads a stale copy; the key depends on no path
or modification time (those only spare a process hashing the same file twice). A copy is written
to a temporary folder and renamed into place, so a reader never sees half of one; a lock beside it
makes a second process wanting the same copy (a pytest worker) wait for the first one's instead of
converting again. A cache that cannot be written (read-only home, full disk) is skipped: the model
still loads, converted afresh.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock, Timeout

T = TypeVar("T")

FORMAT = 1  # what a copy holds: tensors after unpermute_rope_rows, GGUF names; LlamaConfig fields


ENV = "KVSPEC_MODEL_CACHE"


def cache_root() -> Path | None:
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else Path(chosen)
    from kvspec.crash import cache_dir

    return cache_dir() / "models"


def digest(path: Path) -> str:
    st = path.stat()
    return _digest(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:  # once per file version and process
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def entry(path: Path, what: str) -> Path | None:
    """The folder that holds (or would hold) ``what`` ("weights", "tokenizer") of ``path``."""
    root = cache_root()
    if root is None:
        return None
    return root / f"{path.stem}-{digest(path)}-v{FORMAT}" / what


def cached(
    folder: Path | None,
    read: Callable[[Path], T | None],
    make: Callable[[], T],
    write: Callable[[Path, T], None],
) -> T:
    """``read(folder)`` if a copy is there, else ``make()``, stored through ``write``. One process
    at a time makes a given copy; without a usable cache folder, just ``make()``."""
    if folder is None:
        return make()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder) + ".lock")
        lock.acquire(timeout=600)
    except (OSError, Timeout):
        return make()
    try:
        if folder.exists():
            found = read(folder)
            if found is not None:
                return found
            shutil.rmtree(folder, ignore_errors=True)  # unreadable: made again below
        made = make()
        store(folder, lambda tmp: write(tmp, made))
        return made
    finally:
        lock.release()


def store(folder: Path, write: Callable[[Path], None]) -> None:
    """Fill ``folder`` through ``write(tmp)`` atomically; give up quietly if it cannot."""
    try:
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    except OSError:
        return
    try:
        write(tmp)
        os.rename(tmp, folder)  # fails if another writer got there first: theirs stands
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_tensors(folder: Path, converted: tuple[dict, dict]) -> None:
    from safetensors.torch import save_file

    tensors, config = converted
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


def load_tensors(folder: Path) -> tuple[dict, dict] | None:
    """(tensors, config) from a stored copy, or None if there is none (or it is unreadable)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        config = json.loads((folder / "config.json").read_text())
        return load_file(str(folder / "model.safetensors")), config
    except (OSError, ValueError, SafetensorError):
        return None
