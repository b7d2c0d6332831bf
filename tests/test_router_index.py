"""The reference router index (``conformance/kvevents/router_index.py``): longest announced prefix per
engine, and a differential test against a lookup written the slow way from the view."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.conformance.kvevents.router_index import RouterIndex
from kvspec.spec.stream import Batch, Cleared, Removed, Stored, View


def chain(
    hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...], **kw: object
) -> Stored:
    return Stored(hashes, parent, tokens, 2, "GPU", 0, **kw)  # type: ignore[arg-type]


def test_longest_prefix_per_engine() -> None:
    index = RouterIndex()
    index.apply("a", Batch(0, (chain((1, 2, 3), None, (1, 2, 3, 4, 5, 6)),)))
    index.apply("b", Batch(0, (chain((1,), None, (1, 2)), chain((9,), 1, (7, 7)))))
    assert index.lookup("a", [1, 2, 3, 4, 5, 6, 7]) == 3
    assert index.lookup("a", [1, 2, 3, 4, 9, 9]) == 2
    assert index.lookup("b", [1, 2, 7, 7, 1]) == 2
    assert index.lookup("b", [2, 1]) == 0 and index.lookup("nobody", [1, 2]) == 0
    assert index.best([1, 2, 3, 4]) == [("a", 2), ("b", 1)]
    # a removal in the middle of a chain cuts the lookup there
    index.apply("a", Batch(1, (Removed((2,), "GPU", 0),)))
    assert index.lookup("a", [1, 2, 3, 4, 5, 6]) == 1
    index.apply("a", Batch(2, (Cleared(),)))
    assert index.lookup("a", [1, 2]) == 0 and index.snapshot("a") == {}


def test_lora_extra_keys_and_media() -> None:
    index = RouterIndex()
    index.apply("a", Batch(0, (chain((1,), None, (1, 2), lora_name="x"),)))
    index.apply("a", Batch(1, (Stored((2,), None, (3, 4), 2, "CPU", 0, None, (("salt",),)),)))
    assert index.lookup("a", [1, 2]) == 0 and index.lookup("a", [1, 2], lora_name="x") == 1
    assert index.lookup("a", [3, 4]) == 0
    assert index.lookup("a", [3, 4], extra_keys=[("salt",)]) == 1
    assert index.lookup("a", [3, 4], extra_keys=[("salt",)], medium="GPU", any_medium=False) == 0


def test_two_blocks_under_one_hash_and_the_diff_of_a_set_based_index() -> None:
    index = RouterIndex()
    twice = Batch(0, (chain((1,), None, (1, 2)), chain((1,), None, (1, 2))))
    index.apply("a", twice)
    index.apply("a", Batch(1, (Removed((1,), "GPU", 0),)))
    assert index.lookup("a", [1, 2]) == 1  # the engine still holds one block under it
    set_based: dict[tuple[object, ...], int] = {}  # dropped the hash at the first removal
    diff = index.diff("a", set_based)  # type: ignore[arg-type]
    assert diff and diff.missing == (("GPU", 0, 1),) and not diff.extra
    assert not index.diff("a", {("GPU", 0, 1): 1})


def slow_lookup(view: View, tokens: list[int], size: int) -> int:
    """From the definition: the most leading blocks whose whole prefixes are announced chains."""
    best = 0
    for (_, _, _), announced in view.blocks.items():
        prefix: list[int] = []
        node = announced
        ok = True
        while True:
            prefix[:0] = node.tokens
            if node.parent is None:
                break
            parent = view.blocks.get(("GPU", 0, node.parent))
            if parent is None:
                ok = False
                break
            node = parent
        if ok and node.lora_name is None and tokens[: len(prefix)] == prefix:
            best = max(best, len(prefix) // size)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, 2), max_size=6)), max_size=12))
def test_the_index_agrees_with_the_definition(ops: list[tuple[int, list[int]]]) -> None:
    """Random streams of chained stores (hash = the prefix itself), removals and clears."""
    index, view = RouterIndex(), View(next_seq=None)
    from kvspec.spec import stream as spec

    for seq, (kind, tokens) in enumerate(ops):
        tokens = tokens[: len(tokens) // 2 * 2]
        if kind == 0 and tokens:
            hashes = tuple(hash(tuple(tokens[: i + 2])) for i in range(0, len(tokens), 2))
            event: object = chain(hashes, None, tuple(tokens))
        elif kind == 1 and tokens:  # the first or the last block of such a chain
            event = Removed((hash(tuple(tokens[: 2 if len(tokens) % 4 else None])),), "GPU", 0)
        else:
            event = Cleared()
        batch = Batch(seq, (event,))  # type: ignore[arg-type]
        index.apply("e", batch)
        spec.apply_batch(view, batch)
        for probe in ([1, 1, 2, 2, 1, 2], [1, 2, 1, 2], tokens):
            assert index.lookup("e", probe) == slow_lookup(view, list(probe), 2)
