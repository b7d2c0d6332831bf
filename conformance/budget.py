"""The memory budget: every size a file or a flag claims is priced before anything is allocated.

A trace header can claim 10^12 blocks in 60 bytes; ``--heads 100000 --head-dim 4096`` asks for
terabytes of tensors. Nothing kvspec allocates in proportion to such a claim is allocated until
the claim has been priced here and found within the budget; otherwise ``OverBudget`` (a
``ValueError``, so exit 2) says in one line what it would take and how to raise the budget::

    t.jsonl:1: judging 1,000,000,000,000 blocks would take about 3.6 PiB, more than the memory
    budget of 11.5 GiB (raise it with --max-memory 3.7PiB)

The budget is ``--max-memory`` (``set_limit``), else ``KVSPEC_MAX_MEMORY``, else half of the
physical memory (or of the cgroup's limit, when lower). The prices are upper estimates measured
on the structures they stand for (bytes per block of each judge, per element of a tensor, per
byte of a file read whole); ``bench/hostile.py`` and ``tests/test_budget.py`` hold them to that.

``ceiling()`` is the safety net under the estimates: the command line's process gets an address
space limit of what it has mapped at start, plus the budget, plus a margin, so that a size no
estimate foresaw ends in ``MemoryError`` (reported in one line, exit 2), never in the kernel
killing the machine's other work.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

ENV = "KVSPEC_MAX_MEMORY"

MAX_DEPTH = 64
"""The most steps in flight a command or a trace header may claim (engines run 1 to 3; more
only costs memory): ``kvspec fuzz --depth``, ``simulate``, ``generate`` and a header's depth."""

# -- prices (bytes), measured with tracemalloc and rounded up by about half ----------------------

SPEC_JUDGE_PER_BLOCK = 1_400
"""A spec judge for a report (``Judge.stream``, strict or observed): its state, and the
recorder's ring for the minimal history."""
FAST_JUDGE_PER_BLOCK = 450
"""A judge over the fast model (``Judge.fast``), compiled or not."""
CHECKPOINT_COPIES = 3
"""Spec judges alive at once on the fast path of a long file: two checkpoints and the one being
made (``judge/handover.py``)."""
CHECKPOINT_MIN_BYTES = 100_000 * 15
"""A file shorter than this cannot reach the first checkpoint (100,000 events of >= 15 bytes)."""
READ_WHOLE_PER_BYTE = 16
"""Events read whole into tuples (a v0 event file, ``kvspec replay``): 5 to 9 times the file's
bytes measured, up to about 16 for lines of short integers."""
LINE_PER_BYTE = 26
"""A trace line decoded and judged (a prompt of a million tokens on one line): 9 times the
line's bytes on the fast path, 17 on the spec judge's, measured with short integers."""
SPEC_STATE_PER_BLOCK = 400
"""The spec's own state (``replay``'s plan, ``simulate``'s engine): a block record and a free
queue slot."""
SIMULATE_PER_REQUEST = 10_000
SIMULATE_PER_REQUEST_TOKEN = 40
"""``simulate``: a request's prompt (8 blocks of shared prefix, one of its own) and its events,
kept until the file is written: ~7.5 KB per request at block size 16 measured."""
TENSOR_ELEMENT_OVERHEAD = 4
"""The toy model's dense forward: every float32 element also passes through a uint64 array and a
concatenated copy."""


class OverBudget(ValueError):
    """A claimed size that does not fit the memory budget (exit 2, one line)."""

    def __init__(self, where: str, what: str, need: int, limit: int) -> None:
        at = f"{where}: " if where else ""
        raise_it = (
            f"raise it with --max-memory {suggest(need)}"
            if need < MAX_SIZE
            else "no --max-memory is that large"
        )
        self.reason = (
            f"{what} would take about {fmt(need)}, more than the memory budget of "
            f"{fmt(limit)} ({raise_it})"
        )
        """The message without the place."""
        super().__init__(at + self.reason)
        self.need, self.limit = need, limit


# -- the budget -------------------------------------------------------------------------------

_limit: int | None = None


def limit() -> int:
    """The budget in bytes."""
    if _limit is not None:
        return _limit
    text = os.environ.get(ENV)
    if text:
        try:
            return parse_size(text)
        except ValueError as err:
            raise ValueError(f"{ENV}: {err}") from None
    return default_limit()


def set_limit(nbytes: int | None) -> int | None:
    """Set the budget (None: back to the default); return the previous setting."""
    global _limit
    previous, _limit = _limit, nbytes
    return previous


def default_limit() -> int:
    """Half of the physical memory, or of the cgroup's memory limit when that is lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return max(total // 2, 256 << 20)


def require(need: int, what: str, where: str = "") -> None:
    """Raise ``OverBudget`` unless ``need`` bytes fit the budget."""
    budget = limit()
    if need > budget:
        raise OverBudget(where, what, need, budget)


# -- what each reader and command claims -----------------------------------------------------------


def judge_need(num_blocks: int, file_bytes: int | None = None) -> int:
    """Judging a trace of ``num_blocks`` blocks: the fast model, and the spec judges of its
    checkpoints (one when the file is too short for a checkpoint)."""
    copies = 1
    if file_bytes is None or file_bytes >= CHECKPOINT_MIN_BYTES:
        copies = CHECKPOINT_COPIES
    return num_blocks * (FAST_JUDGE_PER_BLOCK + copies * SPEC_JUDGE_PER_BLOCK)


def check_header(num_blocks: int, path: str | Path) -> None:
    """A header's claim of ``num_blocks``, priced for the judges (both formats call this)."""
    try:
        size: int | None = os.path.getsize(path)
    except OSError:
        size = None
    require(judge_need(num_blocks, size), f"judging {num_blocks:,} blocks", f"{path}:1")


def line_cap() -> int:
    """The longest trace line the budget can decode and judge (``LINE_PER_BYTE``)."""
    return max(1, limit() // LINE_PER_BYTE)


def line_over(length: int, where: str) -> OverBudget:
    """The refusal of a line of ``length`` bytes (longer than ``line_cap``)."""
    return OverBudget(where, f"a line of {length:,} bytes", length * LINE_PER_BYTE, limit())


def check_read_whole(path: str | Path, what: str = "reading it whole") -> None:
    """A file that is read into memory at once (v0 event files, ``replay``)."""
    size = os.path.getsize(path)
    require(size * READ_WHOLE_PER_BYTE, f"{what} ({fmt(size)} on disk)", str(path))


def replay_need(
    num_blocks: int,
    block_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    step_tokens: int,
) -> list[tuple[str, int]]:
    """``kvspec replay``'s tensors: the paged KV cache, the slot bookkeeping, and the dense
    forward of the largest step (``step_tokens``: the sum of its entries' context lengths)."""
    cache = 2 * layers * num_blocks * block_size * kv_heads * head_dim * dtype_bytes
    dense = step_tokens * layers * (2 * heads + 2 * kv_heads) * head_dim * 4
    return [
        (f"the KV cache: {layers} layers of {num_blocks:,} blocks of {block_size}", cache),
        ("the cache's slot records", num_blocks * block_size * 8),
        ("the spec's state", num_blocks * SPEC_STATE_PER_BLOCK),
        (
            f"dense attention over the largest step: {step_tokens:,} tokens, "
            f"{heads} heads of {head_dim}",
            dense * TENSOR_ELEMENT_OVERHEAD,
        ),
    ]


def simulate_need(requests: int, num_blocks: int, block_size: int) -> int:
    per_request = SIMULATE_PER_REQUEST + SIMULATE_PER_REQUEST_TOKEN * 9 * block_size
    return requests * per_request + num_blocks * SPEC_STATE_PER_BLOCK


def require_all(parts: list[tuple[str, int]], what: str, where: str = "") -> None:
    """``require`` of a sum; the message names the largest part."""
    need = sum(n for _, n in parts)
    if need > limit():
        biggest = max(parts, key=lambda p: p[1])[0]
        require(need, f"{what}, mostly {biggest},", where)


def weights_need(model: str | Path) -> int:
    """Loading a model's weights as float32: twice the bytes of a 16-bit checkpoint, up to
    eight times those of a 4-bit GGUF file."""
    path = Path(model)
    if path.is_dir():
        files = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")]
    elif path.is_file():
        files = [path]
    else:
        return 0  # a name the loader resolves (smollm2), or a missing path it reports
    need = 0
    for file in files:
        factor = 8 if file.suffix == ".gguf" else 2
        need += file.stat().st_size * factor
    return need


# -- sizes as text ----------------------------------------------------------------------------

MAX_SIZE = 1 << 70
"""The largest budget ``parse_size`` accepts (1 ZiB)."""
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``4G``, ``512MiB``, ``1.5T``, ``1000000`` (bytes); units are powers of 1024."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 4G, 512M, 1.5T)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 1 <= value < MAX_SIZE:
        raise ValueError(f"a size must be at least 1 byte and below 1 ZiB, got {text!r}")
    return int(value)


def fmt(nbytes: int) -> str:
    if nbytes >= MAX_SIZE:
        return f"{nbytes:.2e} bytes"
    value = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            return f"{nbytes:,} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def suggest(nbytes: int) -> str:
    """A ``--max-memory`` value a little above ``nbytes``, as one would type it."""
    value = nbytes * 1.05
    unit = ""
    for name in ("K", "M", "G", "T", "P", "E"):
        if value < 1024:
            break
        value, unit = value / 1024, name
    text = f"{math.ceil(value * 10) / 10:.1f}"
    return (text[:-2] if text.endswith(".0") else text) + unit


# -- the safety net ---------------------------------------------------------------------------

CEILING_MARGIN = 2 << 30
"""Address space above the budget for what is mapped lazily (libraries, thread stacks)."""


@contextlib.contextmanager
def ceiling() -> Iterator[None]:
    """Limit this process's address space to what it has mapped now plus the budget and a
    margin (Linux; elsewhere nothing happens). Restores the previous limit on exit."""
    try:
        import resource

        mapped = _mapped_bytes()
        old = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    soft = mapped + limit() + CEILING_MARGIN
    hard = old[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_AS, old)


def _mapped_bytes() -> int:
    """VmSize of this process (``/proc/self/status``); OSError where there is none."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmSize")
