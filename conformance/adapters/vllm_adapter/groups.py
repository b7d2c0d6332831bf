"""Several KV-cache groups (vLLM's ``HybridKVCacheCoordinator``) as the attachments read them,
in the events and trace that ``docs/hybrid.md`` ("Events and trace") fixes.

vLLM keeps one ``SingleTypeKVCacheManager`` per group over one shared ``BlockPool`` (block ids
are global; the null block is block 0), returns a prefix-cache hit as one list of blocks per
group (``KVCacheBlocks.blocks``), and keys its cached blocks by ``(block hash, group id)``. The
attachment (``attach.py``) keeps its one-group events and adds, where there are several groups,
the trailing ``group`` field (canonical: there only for a group other than 0, as
``spec.events.grouped`` writes it): ``alloc`` takes the group whose manager asked the pool for the
block (``wrap_managers`` marks each manager's calls), ``hit`` is emitted once per group in group
order (``hit_events``), ``publish`` takes the group of the key vLLM inserts, its index counted
in that group's blocks. Frees, evictions and unpublications name global blocks and need none.

``model_groups`` is the trace header's ``model.groups``; ``group_features`` names, feature by
feature, what of the groups kvspec does not follow yet, and ``hybrid_features`` adds that the
spec this build carries models one group where it has no ``Config.groups``: the attachments
refuse every such scheduler by name (``features.scheduler_features``), never judge it wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import get_group_id
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from kvspec.spec import Config
from kvspec.spec import state as spec_state

from . import versions
from .chunked import SPEC_FOLLOWS_CHUNKED, chunk_of, chunked_features, is_chunked

Feature = tuple[str, str]

KINDS = ("full", "window", "state", "cross") + (("chunked",) if SPEC_FOLLOWS_CHUNKED else ())
"""The group kinds kvspec follows (``docs/hybrid.md``; ``cross``: ``docs/model.md``,
"Cross-attention", only as ``CROSS_MODEL``; ``chunked``: ``chunked.py``, where the spec of this
build has it)."""
CROSS_MODEL = ("full", "cross")
"""The groups of the encoder-decoder models kvspec judges: the decoder's full attention, then
a cross-attention group (vLLM's ``CrossAttentionManager``), as Whisper's are grouped and
vLLM's encoder-decoder tests build them."""
MAMBA_MODES = ("align",)
"""The Mamba cache modes kvspec follows: ``align`` (a state at each block boundary a step ended
at), the one vLLM picks with prefix caching on (``MambaModelConfig``)."""
STATE_REGISTRATION = "when-known"
"""How vLLM's ``align`` ``MambaManager`` registers its states (the spec's ``Group.registers``,
``docs/model.md``, "Hybrid groups"): its ``cache_blocks`` walks the Mamba table as a full
group's, from the request's registered count to the last boundary its known tokens reach,
skipping null slots, at every ``allocate_slots`` and post-output registration; so under async
scheduling the state a step writes at a boundary it reached on a placeholder is registered at
the request's next schedule. (Refused as ``Mamba state publication`` before the spec had the
rule: the spec registered a state only in the step ending at its boundary.)"""
MANAGER_METHODS = (
    "allocate_new_blocks",
    "allocate_external_computed_blocks",
    "add_local_computed_blocks",
    "cache_blocks",
    "remove_skipped_blocks",
    "free",
    "pop_blocks_for_free",
)
"""The methods of a group's manager inside which the pool's calls are that group's."""
SPEC_FOLLOWS_GROUPS = "groups" in getattr(Config, "__dataclass_fields__", {})
"""Whether the spec of this build models several groups (``Config.groups``, issue #36)."""
SPEC_FOLLOWS_CROSS = "cross" in getattr(spec_state, "GROUP_KINDS", ())
"""Whether the spec of this build has the cross-attention kind (``docs/model.md``)."""


def group_kind(spec: Any) -> str:
    """A group's kind in ``docs/hybrid.md``'s words (``full``, ``window``, ``state``,
    ``chunked``), or the spec's class name where it is none of them."""
    if isinstance(spec, SlidingWindowSpec):
        return "window"
    if type(spec).__name__ == "CrossAttentionSpec":
        return "cross"
    if isinstance(spec, MambaSpec):
        return "state"
    if is_chunked(spec):
        return "chunked"
    if isinstance(spec, FullAttentionSpec) and type(spec).__name__ == "FullAttentionSpec":
        return "window" if spec.sliding_window else "full"
    return type(spec).__name__


def model_groups(kv_cache_config: Any) -> list[dict[str, Any]]:
    """The trace header's ``model.groups`` for vLLM's ``KVCacheConfig``, in vLLM's group order:
    ``{"kind", "block_size", "window"}`` per group (``docs/hybrid.md``, "Events and trace"),
    and a state group's ``"registers"``: vLLM's rule, ``STATE_REGISTRATION``."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        kind = group_kind(spec)
        read = {"kind": kind, "block_size": spec.block_size, "window": window}
        read |= {"chunk": int(spec.attention_chunk_size)} if kind == "chunked" else {}
        out.append(read | ({"registers": STATE_REGISTRATION} if kind == "state" else {}))
    return out


def kinds_of(sched: Any) -> tuple[str, ...]:
    """The kinds of the scheduler's groups, in group order."""
    return tuple(group_kind(g.kv_cache_spec) for g in sched.kv_cache_config.kv_cache_groups)


def encoder_decoder(sched: Any) -> bool:
    """Whether the scheduler's groups are an encoder-decoder model's that kvspec judges
    (``CROSS_MODEL``) and the spec of this build has the cross kind."""
    return kinds_of(sched) == CROSS_MODEL and SPEC_FOLLOWS_CROSS


def encoder_tokens(request: Any) -> int:
    """The request's encoder tokens as vLLM sizes its cross-attention table: the embeddings of
    every multimodal input (``Request.get_num_encoder_embeds``; an encoder-decoder request's
    inputs all sit at position 0 and are scheduled together, with its first decoder token)."""
    features = getattr(request, "mm_features", None) or ()
    return sum(int(f.mm_position.get_num_embeds()) for f in features)


def encoder_field(sched: Any, request: Any) -> tuple[int, ...]:
    """``arrive``'s trailing ``encoder`` for the request (``spec/events.py``): its encoder
    tokens, on an encoder-decoder scheduler kvspec judges, when not 0; else nothing."""
    count = encoder_tokens(request) if encoder_decoder(sched) else 0
    return (count,) if count else ()


def group_block_sizes(sched: Any) -> tuple[int, ...]:
    """Each group's block size, in group order; for one group (or none) the scheduler's, as
    the one-group events have always counted a ``publish``'s index."""
    groups = sched.kv_cache_config.kv_cache_groups
    if len(groups) < 2:
        return (int(sched.block_size),)
    return tuple(int(g.kv_cache_spec.block_size) for g in groups)


def frees_skipped_blocks(sched: Any) -> bool:
    """Whether some group of several frees blocks a step no longer reads inside
    ``allocate_slots`` (``remove_skipped_blocks``: a window's blocks before the window, an
    ``align`` state group's state two boundaries back): effects of the schedule decision, as
    one plain window's are (``docs/hybrid.md``)."""
    groups = sched.kv_cache_config.kv_cache_groups
    kinds = {group_kind(g.kv_cache_spec) for g in groups}
    return len(groups) > 1 and bool(kinds & {"window", "state", "chunked"})


def group_features(sched: Any) -> list[Feature]:
    """What of a scheduler's several KV-cache groups kvspec does not follow, by feature."""
    found: list[Feature] = []
    groups: Sequence[Any] = sched.kv_cache_config.kv_cache_groups
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = group_kind(spec)
        if kind == "chunked":
            found += chunked_features(sched, spec, f"group {i}: ")
            if i == 0:
                found.append(("chunked local attention", "group 0 of several (not modelled)"))
        elif kind == "cross" and not encoder_decoder(sched):
            found.append(("cross-attention", f"group {i} of {'+'.join(kinds_of(sched))}"))
        elif kind not in KINDS:
            found.append((f"KV-cache spec {kind}", f"group {i}: not full, window or state"))
        if kind == "state" and versions.read(spec, "mamba_cache_mode") not in MAMBA_MODES:
            found.append((f"Mamba cache mode {spec.mamba_cache_mode}", f"group {i}"))
        if kind == "window" and getattr(spec, "extra_retained_tokens", 0):
            found.append(("sliding window", f"group {i}: extra retained tokens"))
        role = getattr(group, "role", None)
        if role is not None and getattr(role, "name", "DEFAULT") != "DEFAULT":
            found.append((f"KV-cache group role {role.name}", f"group {i}"))
    sizes = [g.kv_cache_spec.block_size for g in groups]
    hash_bsz = int(versions.read(sched, "hash_block_size"))
    if any(size != hash_bsz for size in sizes):
        found.append(
            ("hash block size below block size", f"hash blocks of {hash_bsz}, groups' {sizes}")
        )
    if versions.read(sched, "mamba_partial_cache_hit"):
        found.append(("partial prefix-cache hits", "Mamba states inside a block"))
    if sched.connector is not None:
        found.append(("hybrid KV-cache groups", "beside a KV connector"))
    if versions.read(sched, "num_spec_tokens") or versions.read(sched, "use_eagle"):
        found.append(("hybrid KV-cache groups", "with speculative decoding"))
    return found


def hybrid_features(sched: Any) -> list[Feature]:
    """``group_features`` of a scheduler with several groups, and, where nothing else is
    refused and the spec of this build has no ``Config.groups``, that it models one group."""
    groups = sched.kv_cache_config.kv_cache_groups
    if len(groups) < 2:
        return []
    found = group_features(sched)
    if not SPEC_FOLLOWS_GROUPS:
        kinds = "+".join(group_kind(g.kv_cache_spec) for g in groups)
        found.append(("hybrid KV-cache groups", f"{kinds}: this build's spec has no Config.groups"))
    return found


# -- the attachment's part ----------------------------------------------------------------------


def group_of_key(key: Any) -> int:
    """The group of a key of vLLM's cached-block index (``BlockHashWithGroupId``)."""
    return int(get_group_id(key))


def wrap_managers(attachment: Any) -> None:
    """Mark each group manager's calls, so that the pool's calls inside them are that group's
    (``Attachment._group``)."""
    managers = versions.read(attachment.kv.coordinator, "single_type_managers")
    for i, manager in enumerate(managers):
        for name in MANAGER_METHODS:
            if hasattr(manager, name):
                attachment.wrappers.install(manager, name, _in_group(attachment, i))


def _in_group(attachment: Any, group: int) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def in_group(*args: Any, **kw: Any) -> Any:
            before, attachment._group = attachment._group, group
            try:
                return original(*args, **kw)
            finally:
                attachment._group = before

        return in_group

    return make


def hit_events(attachment: Any, rid: int | None, hits: Any) -> tuple[int, ...]:
    """Emit an admission's ``hit`` once per group, in group order (a group with nothing hit
    too); return every group's hit blocks in that order (vLLM touches them so)."""
    per_group = list(hits.blocks) if hits is not None else []
    per_group += [[]] * (len(attachment.group_sizes) - len(per_group))
    every: list[int] = []
    for group, blocks in enumerate(per_group):
        ids = tuple(b.block_id for b in blocks)
        attachment.events.append(("hit", rid, ids) + ((group,) if group else ()))
        every += ids
    return tuple(every)


def spec_groups(sched: Any) -> dict[str, Any]:
    """``Config``'s ``groups`` field for a scheduler of several groups, where the spec of this
    build has it (else nothing: ``hybrid_features`` refuses the scheduler)."""
    groups = sched.kv_cache_config.kv_cache_groups
    if len(groups) < 2 or not SPEC_FOLLOWS_GROUPS:
        return {}
    from kvspec.spec.state import Group as group

    read = model_groups(sched.kv_cache_config)
    if any(g["kind"] not in KINDS for g in read):  # refused by name (group_features), not built
        return {}
    specs = [g.kv_cache_spec for g in groups]
    chunked = [i for i, g in enumerate(read) if g["kind"] == "chunked"]
    if 0 in chunked or any(chunk_of(specs[i]) is None for i in chunked):  # refused, not built
        return {}
    return {
        "groups": tuple(
            group(g["kind"], g["block_size"], window=g["window"], registers=g.get("registers"))
            if g["kind"] != "chunked"
            else group("chunked", g["block_size"], chunk=g["chunk"])
            for g in read
        )
    }
