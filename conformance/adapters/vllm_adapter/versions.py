"""vLLM's non-public names, per supported release: the one module that knows what they are.

The vLLM adapter and the pytest plugin read vLLM's internals (a scheduler's flags, the block-hash
index, the runner output's layout, a request's prefix-cache read). Those names move between
releases, so every such read goes through here, where each supported release says what the name
is. Nothing else in ``vllm_adapter`` guesses: a read that finds no attribute is a *named
refusal* (``MissingName``, "vLLM 0.x: ``Request.foo`` not found; kvspec supports ..."), which the
attachments record as a refusal, never a silent default (a ``getattr(obj, name, False)`` on a
feature flag is how a false alarm gets in) and never a kvspec internal error.

``installed()`` is the release in this process (``vllm.__version__``). A version outside
``SUPPORTED`` is tried with the names of the newest supported release not newer than it (else the
oldest), and says once, on stderr and as a warning, which versions are supported. How to follow
the next release: ``docs/adapters.md`` ("Following vLLM").
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

SUPPORTED = ("0.33.0", "0.34.0")
FEATURE = "vLLM version"
"""The refusal's feature name when a name this module reads is missing."""


@dataclass(frozen=True)
class Release:
    """What one vLLM release calls the things kvspec reads."""

    version: str
    runner_v2_flag: bool
    """``Scheduler.use_v2_model_runner`` exists (0.33.0); 0.34.0 removed Model Runner V1."""
    output_index: str
    """``ModelRunnerOutput``'s per-request index: ``req_id_to_index`` (0.33.0) or the order of
    ``req_ids`` (0.34.0)."""
    hash_map_holds_ids: bool
    """``BlockHashToBlockMap._cache`` maps a key to block *ids*, duplicates in ``_dup_ids``
    (0.34.0), rather than to a block or a dict of blocks (0.33.0)."""
    evict_first: bool
    """``BlockPool.free_blocks(ordered_blocks, evict_first=False)`` (0.34.0)."""
    prefix_read: str
    """The request's prefix-cache read: ``skip_reading_prefix_cache`` (0.33.0, a flag) or
    ``prefix_cache_hit_limit`` (0.34.0: None unbounded, 0 skipped, n a bounded read)."""
    cpu_needs_triton: bool
    """``CpuPlatform.check_and_update_config`` raises on an x86 CPU without triton-cpu (0.34.0;
    0.33.0 warned): ``cpu_platform.py``."""
    admission_window: bool
    """``SchedulerConfig.cache_aware_admission_window`` and ``max_num_inflight_kv_loads``, the
    ``async_kv_waiting`` queue (0.34.0)."""
    event_extra_keys: str
    """``vllm.distributed.kv_events``' helper for a block's extra keys (read by nothing of
    kvspec's today; kept so that a use starts here)."""


RELEASES: Mapping[str, Release] = {
    "0.33.0": Release(
        "0.33.0",
        runner_v2_flag=True,
        output_index="req_id_to_index",
        hash_map_holds_ids=False,
        evict_first=False,
        prefix_read="skip_reading_prefix_cache",
        cpu_needs_triton=False,
        admission_window=False,
        event_extra_keys="_generate_event_extra_keys",
    ),
    "0.34.0": Release(
        "0.34.0",
        runner_v2_flag=False,
        output_index="req_ids",
        hash_map_holds_ids=True,
        evict_first=True,
        prefix_read="prefix_cache_hit_limit",
        cpu_needs_triton=True,
        admission_window=True,
        event_extra_keys="generate_event_extra_keys",
    ),
}


class MissingName(Exception):
    """A name kvspec reads is not in the installed vLLM: refused by name (``FEATURE``)."""

    feature = FEATURE

    def __init__(self, owner: str, name: str) -> None:
        self.detail = (
            f"vLLM {installed().version}: `{owner}.{name}` not found; "
            f"kvspec supports {', '.join(SUPPORTED)}"
        )
        super().__init__(self.detail)


def _key(version: str) -> tuple[int, ...]:
    """The release numbers of ``version``, each part's leading digits (``0.34.0rc1``: 0, 34, 0)."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _release(version: str) -> str:
    """A build of a release (``0.34.0+cpu``) is that release."""
    return version.split("+")[0]


def release_for(version: str) -> Release:
    """The names kvspec uses for ``version``: its own where supported, else those of the newest
    supported release not newer than it (the oldest where it is older than all)."""
    if _release(version) in RELEASES:
        return RELEASES[_release(version)]
    older = [v for v in SUPPORTED if _key(v) <= _key(version)]
    return RELEASES[max(older, key=_key) if older else SUPPORTED[0]]


def unsupported_message(version: str) -> str | None:
    """The one message a version outside ``SUPPORTED`` gets, or None."""
    if _release(version) in RELEASES:
        return None
    tried = release_for(version).version
    return (
        f"kvspec: vLLM {version} is not a supported version (kvspec supports "
        f"{', '.join(SUPPORTED)}); trying it with {tried}'s names: a name that moved is refused "
        "by name, never guessed"
    )


@lru_cache(maxsize=1)
def installed() -> Release:
    """The release of the vLLM in this process (said once where it is not supported)."""
    import vllm

    version = str(vllm.__version__)
    message = unsupported_message(version)
    if message is not None:
        print(message, file=sys.stderr)
        warnings.warn(message, stacklevel=2)
        return Release(**{**release_for(version).__dict__, "version": version})
    return RELEASES[_release(version)]


def read(obj: Any, name: str) -> Any:
    """``obj.name``, a vLLM attribute kvspec reads; ``MissingName`` where it is not there."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise MissingName(type(obj).__name__, name) from None


# -- the names that moved ----------------------------------------------------------------------


def uses_runner_v2(scheduler: Any) -> bool:
    """Whether the scheduler runs with Model Runner V2 (0.34.0 has no other)."""
    if installed().runner_v2_flag:
        return bool(read(scheduler, "use_v2_model_runner"))
    return True


def runner_output(req_ids: list[str], sampled_token_ids: list[list[int]]) -> Any:
    """A ``ModelRunnerOutput`` with these requests' sampled tokens, indexed as the release
    indexes them."""
    from vllm.v1.outputs import ModelRunnerOutput

    if installed().output_index == "req_id_to_index":
        index = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index=index, sampled_token_ids=sampled_token_ids
        )
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids)


def output_index(runner: Any) -> dict[str, int]:
    """Request id -> its row in a ``ModelRunnerOutput``."""
    if installed().output_index == "req_id_to_index":
        return dict(read(runner, "req_id_to_index") or {})
    return {r: i for i, r in enumerate(read(runner, "req_ids") or ())}


def cached_block_ids(pool: Any) -> dict[Any, tuple[int, ...]]:
    """The pool's block-hash index: key -> the ids of the blocks registered under it (the one a
    lookup returns first)."""
    index = read(read(pool, "cached_block_hash_to_block"), "_cache")
    out: dict[Any, tuple[int, ...]] = {}
    if installed().hash_map_holds_ids:
        dups = read(pool.cached_block_hash_to_block, "_dup_ids")
        for key, block_id in index.items():
            extra = dups.get(key)
            out[key] = tuple(extra) if extra else (int(block_id),)
        return out
    for key, blocks in index.items():
        if isinstance(blocks, dict):
            out[key] = tuple(b.block_id for b in blocks.values())
        else:
            out[key] = (blocks.block_id,)
    return out


def evict_first(args: tuple[Any, ...], kw: Mapping[str, Any]) -> bool:
    """Whether a ``free_blocks(ordered_blocks, *args, **kw)`` call asks for ``evict_first``."""
    if not installed().evict_first:
        return False
    return bool(kw.get("evict_first", args[0] if args else False))


def prefix_read_limit(request: Any) -> int | None:
    """The request's prefix-cache read: None unbounded, 0 skipped, n > 0 at most n tokens."""
    if installed().prefix_read == "skip_reading_prefix_cache":
        return 0 if read(request, "skip_reading_prefix_cache") else None
    limit = read(request, "prefix_cache_hit_limit")
    return None if limit is None else int(limit)


def max_cache_hit_length(request: Any, bound: int | None) -> int:
    """The longest prefix-cache hit ``KVCacheManager.get_computed_blocks(request, bound)``
    looks for: 0.33.0 takes ``bound`` as given, else the request's tokens but the last; 0.34.0
    tightens that by the request's ``prefix_cache_hit_limit`` too."""
    if installed().prefix_read == "skip_reading_prefix_cache":
        return int(request.num_tokens - 1 if bound is None else bound)
    limits = (request.num_tokens - 1, prefix_read_limit(request), bound)
    return int(min(limit for limit in limits if limit is not None))


def admission_window(scheduler: Any) -> int:
    """Cache-aware admission's window (0: off, and always so before 0.34.0)."""
    if not installed().admission_window:
        return 0
    return int(read(scheduler, "cache_aware_window") or 0)


def admission_threshold(scheduler: Any) -> float:
    """Cache-aware admission's usage threshold (vLLM's default 0.5 before 0.34.0, unread there)."""
    if not installed().admission_window:
        return 0.5
    return float(read(scheduler, "cache_aware_threshold"))


def inflight_kv_loads(scheduler: Any) -> int | None:
    """``max_num_inflight_kv_loads`` (None: off, and always so before 0.34.0)."""
    if not installed().admission_window:
        return None
    return read(read(scheduler, "scheduler_config"), "max_num_inflight_kv_loads")  # type: ignore[no-any-return]


def async_kv_waiting(scheduler: Any) -> int:
    """Requests in the ``async_kv_waiting`` queue (0.34.0; none before)."""
    if not installed().admission_window:
        return 0
    return len(read(scheduler, "async_kv_waiting"))


__all__ = [
    "FEATURE",
    "RELEASES",
    "SUPPORTED",
    "MissingName",
    "Release",
    "admission_window",
    "async_kv_waiting",
    "cached_block_ids",
    "evict_first",
    "inflight_kv_loads",
    "installed",
    "max_cache_hit_length",
    "output_index",
    "prefix_read_limit",
    "read",
    "release_for",
    "runner_output",
    "unsupported_message",
    "uses_runner_v2",
]
