"""Chunked local attention (Llama 4's, vLLM's ``ChunkedLocalAttentionSpec`` under a
``ChunkedLocalAttentionManager``) as the attachments judge it: the spec's ``chunked`` group kind
(``Group("chunked", B, chunk=C)``, ``docs/model.md``, "Chunked local attention").

vLLM's tests build it as the scheduler's one KV-cache group (``test_swa_inflight_window_free.py``'s
``_create_chunked_scheduler``); a model mixes it with full attention (Llama 4's every fourth layer
is global), which the hybrid coordinator groups as full + chunked. The manager's skipped frees
run inside ``allocate_slots`` (``remove_skipped_blocks`` on the processed tokens, as a window's),
so they are the ``free`` effects of the ``schedule`` decision (``attach_blocks``), and its hit
holds the null block before the chunk of the hit's cap, as the spec's rule does. What the spec
does not model beside it is refused by name: a KV connector (its loads and finish would need
the chunk's ``WindowLoad`` and ``WindowFinish``), drafts, and a chunk that is not a whole number
of blocks."""

from __future__ import annotations

from typing import Any

from kvspec.spec import state as spec_state

from .versions import read

Feature = tuple[str, str]

SPEC_FOLLOWS_CHUNKED = "chunked" in getattr(spec_state, "GROUP_KINDS", ())
"""Whether the spec of this build has the chunked kind (else every chunked group is refused)."""


def is_chunked(spec: Any) -> bool:
    """The KV-cache spec is vLLM's chunked local attention."""
    return type(spec).__name__ == "ChunkedLocalAttentionSpec" or bool(
        getattr(spec, "attention_chunk_size", None)
    )


def chunk_of(spec: Any) -> int | None:
    """C of a chunked group the spec follows: a plain ``ChunkedLocalAttentionSpec`` whose chunk
    is a whole number of its blocks, on a build whose spec has the kind; None otherwise."""
    if not SPEC_FOLLOWS_CHUNKED or type(spec).__name__ != "ChunkedLocalAttentionSpec":
        return None
    chunk, size = int(spec.attention_chunk_size), int(spec.block_size)
    return chunk if chunk >= size and chunk % size == 0 else None


def one_chunked_group(sched: Any) -> int | None:
    """C of a scheduler whose one KV-cache group is chunked local attention the spec follows,
    under vLLM's ``ChunkedLocalAttentionManager``; None otherwise."""
    groups = sched.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return None
    managers = read(sched.kv_cache_manager.coordinator, "single_type_managers") or ()
    if len(managers) != 1 or type(managers[0]).__name__ != "ChunkedLocalAttentionManager":
        return None
    return chunk_of(groups[0].kv_cache_spec)


def chunked_features(sched: Any, spec: Any, where: str = "") -> list[Feature]:
    """What of a chunked group (``where``: which, for one of several) kvspec does not follow:
    all of it where the spec of this build lacks the kind or the chunk is no whole number of
    blocks; beside a KV connector or drafts (the spec models neither beside it)."""
    detail = f"{where}{type(spec).__name__}({read(spec, 'attention_chunk_size')})"
    if chunk_of(spec) is None:
        return [("chunked local attention", detail)]
    if sched.connector is not None:
        return [("chunked local attention", f"{detail} beside a KV connector")]
    if read(sched, "num_spec_tokens") or read(sched, "use_eagle"):
        return [("chunked local attention", f"{detail} with speculative decoding")]
    return []


def spec_groups(sched: Any) -> dict[str, Any]:
    """``Config``'s ``groups`` for a scheduler of one chunked group (``one_chunked_group``);
    nothing otherwise (several groups are ``groups.spec_groups``')."""
    chunk = one_chunked_group(sched)
    if chunk is None:
        return {}
    size = int(sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    return {"groups": (spec_state.Group("chunked", size, chunk=chunk),)}
