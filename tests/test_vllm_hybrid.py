"""vLLM's hybrid models through the adapter (``vllm_adapter/hybrid.py``, ``groups.py``): run
where vLLM imports (``tests/test_vllm_hybrid_releases.py`` runs this file in every supported
release's environment).

The two models are built from their ``config.json`` with vLLM's groups and defaults; the header's
groups are read from vLLM's ``KVCacheConfig``; the events carry the group vLLM's own tables put
each block in (checked against the managers' tables after every step of a workload that hits
across requests); what kvspec does not follow is refused by its feature's name; and while the
spec has no ``Config.groups`` the factories refuse the cell by name rather than judge it."""

from __future__ import annotations

import os
import random
import types
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM resolves its platform
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from kvspec.conformance.adapters.vllm_adapter import groups, hybrid  # noqa: E402
from kvspec.spec import Config  # noqa: E402
from kvspec.spec.events import group_of  # noqa: E402

CELL = Config(
    num_blocks=24,
    block_size=4,
    token_budget=16,
    max_running=4,
    policy="eager-unsafe",
    discipline="vllm",
    depth=2,
    stop_token=0,
)


class Tokens:
    """The fake runner's sampled tokens, from a seeded generator (never the stop token)."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def pick(self, n: int, label: str = "") -> int:
        return self.random.randrange(1, n)


def adapter(model: str, seed: int = 0) -> Any:
    return hybrid.ADAPTERS[model](CELL, Tokens(seed), async_scheduling=True)


@pytest.mark.parametrize(
    ("model", "kinds", "managers"),
    [
        ("swa", ["window", "full"], ["SlidingWindowManager", "FullAttentionManager"]),
        ("swa-full-first", ["full", "window"], ["FullAttentionManager", "SlidingWindowManager"]),
        ("mamba", ["full", "state"], ["FullAttentionManager", "MambaManager"]),
    ],
)
def test_each_model_is_built_as_vllm_groups_it(
    model: str, kinds: list[str], managers: list[str]
) -> None:
    a = adapter(model)
    sched = a.scheduler
    assert type(sched).__name__ == "AsyncScheduler"
    assert type(sched.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert [
        type(m).__name__ for m in sched.kv_cache_manager.coordinator.single_type_managers
    ] == managers
    header = groups.model_groups(sched.kv_cache_config)
    assert [g["kind"] for g in header] == kinds
    assert all(g["block_size"] == CELL.block_size for g in header)
    window = hybrid.WINDOW_BLOCKS * CELL.block_size
    assert [g["window"] for g in header] == [window if k == "window" else None for k in kinds]
    if model == "mamba":  # the cache mode vLLM picks with prefix caching on
        assert sched.vllm_config.cache_config.mamba_cache_mode == "align"
    assert sched.hash_block_size == sched.block_size == CELL.block_size
    assert [g.get("registers") for g in header] == [
        "when-known" if k == "state" else None for k in kinds
    ]  # vLLM's align MambaManager registers a state once its boundary's tokens are known
    assert [name for name, _ in groups.group_features(sched)] == []


def test_the_factories_refuse_by_name_while_the_spec_has_one_group() -> None:
    if groups.SPEC_FOLLOWS_GROUPS:
        pytest.skip("the spec models several groups: the factories build")
    for factory in (hybrid.swa_factory, hybrid.mamba_factory):
        with pytest.raises(ValueError, match="hybrid KV-cache groups"):
            factory(CELL, Tokens(0))
    for model in hybrid.MODELS:  # that alone: a Mamba align group is not "Mamba layers"
        a = adapter(model)
        assert a.refusal is not None and "hybrid KV-cache groups" in a.refusal.features
        assert "Mamba layers" not in a.refusal.features
        assert a.refusal.at == "construction"


def test_the_factories_build_with_vllm_groups_in_their_config() -> None:
    if not groups.SPEC_FOLLOWS_GROUPS:
        pytest.skip("the spec has no Config.groups: the factories refuse")
    for factory, kinds in (
        (hybrid.swa_factory, ("window", "full")),
        (hybrid.mamba_factory, ("full", "state")),
    ):
        a = factory(CELL, Tokens(0))
        assert a.refusal is None, a.refusal
        assert tuple(g.kind for g in a.config.groups) == kinds
        assert a.config.groups == a.attachment.config.groups
        read = groups.model_groups(a.scheduler.kv_cache_config)
        assert [(g.kind, g.block_size, g.window, g.registers) for g in a.config.groups] == [
            (g["kind"], g["block_size"], g["window"], g.get("registers")) for g in read
        ]


def _fake(spec_groups: list[Any], hash_block_size: int = 4, **flags: Any) -> Any:
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=spec_groups)
    values = {"num_spec_tokens": 0, "use_eagle": False, "mamba_partial_cache_hit": False} | flags
    return types.SimpleNamespace(
        kv_cache_config=config, hash_block_size=hash_block_size, connector=None, **values
    )


FULL = KVCacheGroupSpec(
    ["f"], FullAttentionSpec(4, num_kv_heads=1, head_size=1, dtype=torch.float32)
)


def _mamba(mode: str, block_size: int = 4) -> KVCacheGroupSpec:
    spec = MambaSpec(
        block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode=mode
    )
    return KVCacheGroupSpec(["m"], spec)


@pytest.mark.parametrize(
    ("sched", "feature"),
    [
        (_fake([FULL, _mamba("all")]), "Mamba cache mode all"),
        (_fake([FULL, _mamba("align", 8)]), "hash block size below block size"),
        (
            _fake(
                [
                    KVCacheGroupSpec(
                        ["c"],
                        ChunkedLocalAttentionSpec(
                            4,
                            num_kv_heads=1,
                            head_size=1,
                            dtype=torch.float32,
                            attention_chunk_size=8,
                        ),
                    ),
                    FULL,
                ]
            ),
            "chunked local attention",
        ),
        (_fake([FULL, _mamba("align")], mamba_partial_cache_hit=True), "partial prefix-cache hits"),
        (_fake([FULL, _mamba("align")], num_spec_tokens=2), "hybrid KV-cache groups"),
    ],
)
def test_what_is_not_followed_is_refused_by_its_name(sched: Any, feature: str) -> None:
    assert feature in [name for name, _ in groups.group_features(sched)]


def test_a_plain_pair_of_groups_names_nothing_but_the_spec() -> None:
    found = groups.hybrid_features(_fake([FULL, _mamba("align")]))
    expected = [] if groups.SPEC_FOLLOWS_GROUPS else ["hybrid KV-cache groups"]
    assert [name for name, _ in found] == expected


def _workload(a: Any, check: Any) -> None:
    """A prompt run alone, then two requests sharing its prefix (one a longer share), each step
    followed by ``check``."""
    prefix = (1, 2, 3) * 4
    a.add_request(0, prefix + (1, 2, 3), 4, 0)
    while a.step():
        check()
    a.add_request(1, prefix + (3, 3), 3, 0)
    a.add_request(2, prefix[:9] + (2,) * 9, 3, 0)
    while a.step():
        check()


def _table_checker(a: Any) -> tuple[Any, dict[str, int]]:
    """Check the events since the last call against vLLM's managers' tables: an ``alloc``'s
    block, a ``publish``'s block at its index and a ``hit``'s blocks are where the event's group
    says, in that group's manager's table of the request (where vLLM has not nulled or freed
    them since)."""
    managers = a.scheduler.kv_cache_manager.coordinator.single_type_managers
    seen = {"at": 0, "alloc": 0, "publish": 0, "hit": 0, "state_hit": 0, "window_null": 0}

    def table(rid: int, group: int) -> list[int]:
        return [b.block_id for b in managers[group].req_to_blocks.get(str(rid), [])]

    def check() -> None:
        new, seen["at"] = a.events[seen["at"] :], len(a.events)
        for event in new:
            group = group_of(event)
            if event[0] == "alloc":
                _, rid, block = event[:3]
                others = [g for g in range(len(managers)) if block in table(rid, g)]
                assert others in ([], [group]), (event, others)
                seen["alloc"] += bool(others)
            elif event[0] == "publish":
                _, rid, index, block = event[:4]
                held = table(rid, group)
                if index < len(held) and held[index] != 0:
                    assert held[index] == block, (event, held)
                    seen["publish"] += 1
            elif event[0] == "hit":
                _, rid, blocks = event[:3]
                held = table(rid, group)
                for i, block in enumerate(blocks):
                    if i < len(held) and held[i] != 0 and block != 0:
                        assert held[i] == block, (event, held)
                        seen["hit"] += 1
                kind = groups.group_kind(managers[group].kv_cache_spec)
                seen["state_hit"] += kind == "state" and any(blocks)
                seen["window_null"] += kind == "window" and 0 in blocks and any(blocks)

    return check, seen


@pytest.mark.parametrize("model", hybrid.MODELS)
def test_events_name_the_group_vllm_puts_each_block_in(model: str) -> None:
    a = adapter(model)
    check, seen = _table_checker(a)
    _workload(a, check)
    assert a.problems == [] and a.self_check() is None
    # the workload reaches every event kind, and the hybrid hits it exists for
    assert seen["alloc"] and seen["publish"] and seen["hit"], seen
    assert seen["state_hit" if model == "mamba" else "window_null"], seen
    hits = [e for e in a.events if e[0] == "hit"]
    assert len(hits) == 3 * 2 and [group_of(e) for e in hits] == [0, 1] * 3  # per group, in order
    assert all(len(e) == 3 for e in a.events if e[0] == "hit" and not group_of(e))  # canonical


def test_a_group_the_spec_has_no_kind_for_is_refused_not_built() -> None:
    """A chunked group first of several or of a chunk no whole number of blocks, or a
    cross-attention group anywhere but in the encoder-decoder layout (``groups.CROSS_MODEL``: a
    decoder full-attention group and a cross group, judged since h-cross): ``group_features``
    names it, so the attachment refuses it at construction (no ``Config.groups`` is built:
    ``Group`` would raise). A chunked group after a full one maps to the spec's ``chunked``
    kind (h-chunked), and the encoder-decoder layout to its ``cross`` kind, named by nothing."""

    def chunked_of(chunk: int) -> KVCacheGroupSpec:
        spec = ChunkedLocalAttentionSpec(
            4, num_kv_heads=1, head_size=1, dtype=torch.float32, attention_chunk_size=chunk
        )
        return KVCacheGroupSpec(["c"], spec)

    cross = KVCacheGroupSpec(["x"], type("CrossAttentionSpec", (), {"block_size": 4})())
    sched = _fake([FULL, chunked_of(8)])
    assert [(g.kind, g.chunk) for g in groups.spec_groups(sched)["groups"]] == [
        ("full", None),
        ("chunked", 8),
    ]
    assert not groups.group_features(sched)
    for layout in ([chunked_of(8), FULL], [FULL, chunked_of(6)]):
        sched = _fake(layout)
        assert groups.spec_groups(sched) == {}, layout
        assert "chunked local attention" in [n for n, _ in groups.group_features(sched)], layout
    for layout in ([FULL, FULL, cross], [cross, FULL]):  # the spec has the kind: refused by name
        sched = _fake(layout)
        assert "cross-attention" in [name for name, _ in groups.group_features(sched)], layout
    sched = _fake([FULL, cross])
    assert [g.kind for g in groups.spec_groups(sched)["groups"]] == ["full", "cross"]
    assert "cross-attention" not in [name for name, _ in groups.group_features(sched)]
