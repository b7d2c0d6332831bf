"""The KV-event stream's spec (``spec/stream.py``) and its judge (``conformance/kvevents/stream_judge.py``):
a clean stream holds, and each invariant names the fault planted for it."""

from __future__ import annotations

import pytest

from kvspec.conformance.kvevents.stream_judge import StreamJudge
from kvspec.spec import stream as s
from kvspec.spec.stream import Batch, Cleared, Removed, Stored

GPU = dict(medium="GPU", group=0)


def stored(
    hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...], **kw: object
) -> Stored:
    return Stored(hashes, parent, tokens, 2, **{**GPU, **kw})  # type: ignore[arg-type]


def removed(*hashes: int, **kw: object) -> Removed:
    return Removed(hashes, **{**GPU, **kw})  # type: ignore[arg-type]


CLEAN = [
    Batch(0, (stored((1, 2), None, (1, 2, 3, 4)),)),
    Batch(1, (stored((3,), 2, (5, 6)), removed(3))),
    Batch(2, (removed(2), removed(1), Cleared(), stored((7,), None, (9, 9)))),
]


def judge_all(batches: list[Batch], **options: object) -> tuple[str | None, int | None]:
    judge = StreamJudge(**options)  # type: ignore[arg-type]
    for batch in batches:
        if judge.feed(batch) is not None:
            assert judge.finding is not None
            return judge.finding.invariant, batch.seq
    return None, None


def test_a_clean_stream_holds_and_the_view_follows_it() -> None:
    judge = StreamJudge()
    for batch in CLEAN:
        assert judge.feed(batch) is None
    view = judge.view
    assert view is not None and set(view.blocks) == {("GPU", 0, 7)}
    assert view.next_seq == 3 and judge.stats.events == 7
    assert judge.report("x").exit_code == 0


@pytest.mark.parametrize(
    ("batches", "invariant", "seq"),
    [
        # a removal of a hash never stored (or stored after it: a reordered batch)
        ([Batch(0, (removed(5),))], "RemovalNamesAnnounced", 0),
        (
            [Batch(0, (stored((3,), 2, (5, 6)),)), Batch(1, (stored((1, 2), None, (1, 2, 3, 4)),))],
            "ParentAnnounced",
            0,
        ),
        # a gap the replay socket did not fill, a batch sent twice, a restarted publisher
        ([CLEAN[0], CLEAN[2]], "SequenceInOrder", 2),
        ([CLEAN[0], CLEAN[0]], "SequenceInOrder", 0),
        ([CLEAN[0], CLEAN[1], Batch(0, ())], "SequenceInOrder", 0),
        # after a clear: a removal of, or a child of, a block the clear dropped
        ([CLEAN[0], Batch(1, (Cleared(), removed(2)))], "ClearEmptiesView", 1),
        ([CLEAN[0], Batch(1, (Cleared(), stored((3,), 2, (5, 6))))], "ClearEmptiesView", 1),
        # malformed stores, and one hash for two prefixes
        ([Batch(0, (stored((1, 2), None, (1, 2, 3)),))], "StoreConsistent", 0),
        ([Batch(0, (stored((1,), None, (1, 2), extra_keys=((), ())),))], "StoreConsistent", 0),
        ([CLEAN[0], Batch(1, (stored((1,), None, (8, 8)),))], "StoreConsistent", 1),
    ],
)
def test_each_planted_fault_is_named(batches: list[Batch], invariant: str, seq: int) -> None:
    assert judge_all(batches) == (invariant, seq)


def test_a_block_stored_twice_is_announced_until_both_are_removed() -> None:
    """vLLM does not deduplicate equal blocks: two stores of one hash, then two removals."""
    twice = [
        Batch(0, (stored((1,), None, (1, 2)), stored((1,), None, (1, 2)))),
        Batch(1, (removed(1),)),
        Batch(2, (removed(1),)),
    ]
    judge = StreamJudge()
    assert judge.feed(twice[0]) is None and judge.feed(twice[1]) is None
    assert judge.view is not None and judge.view.blocks[("GPU", 0, 1)].count == 1
    assert judge.feed(twice[2]) is None and not judge.view.blocks
    # what a set-based router needs, judged only when asked for
    assert judge_all(twice, invariants=["StoreNamesNewHash"]) == ("StoreNamesNewHash", 0)
    assert judge_all(twice + [Batch(3, (removed(1),))]) == ("RemovalNamesAnnounced", 3)


def test_media_and_groups_are_separate_views_but_parents_may_be_in_another_medium() -> None:
    gpu = stored((1,), None, (1, 2))
    cpu_child = stored((2,), 1, (3, 4), medium="CPU")
    other_group_child = stored((2,), 1, (3, 4), group=1)
    assert judge_all([Batch(0, (gpu, cpu_child))]) == (None, None)
    assert judge_all([Batch(0, (gpu, other_group_child))]) == ("ParentAnnounced", 0)
    assert judge_all([Batch(0, (gpu, removed(1, medium="CPU")))]) == ("RemovalNamesAnnounced", 0)


def test_a_subscriber_that_joined_late_is_excused_until_the_first_clear() -> None:
    late = [
        Batch(7, (removed(40), stored((2,), 41, (3, 4)))),
        Batch(8, (Cleared(), removed(42))),
    ]
    judge = StreamJudge()
    assert judge.feed(late[0]) is None and judge.joined_at == 7
    assert judge.feed(late[1]) is not None
    assert judge.finding is not None and judge.finding.invariant == "RemovalNamesAnnounced"
    assert "joined the stream at batch 7" in (judge.report("x").note or "")
    assert judge_all(late, join=False) == ("SequenceInOrder", 7)


def test_capacity_catches_a_lost_removal() -> None:
    """Three blocks on an engine of two: a removal was lost."""
    batches = [
        Batch(0, (stored((1, 2), None, (1, 2, 3, 4)),)),
        Batch(1, (stored((3,), None, (5, 6)),)),  # the engine evicted 2 for it: not said
    ]
    assert judge_all(batches) == (None, None)
    assert judge_all(batches, capacity=2) == ("ViewWithinCapacity", 1)


def test_the_view_equals_the_engines_cache_at_a_boundary() -> None:
    judge = StreamJudge()
    judge.feed(CLEAN[0])
    assert judge.boundary({(0, 1): 1, (0, 2): 1}) is None
    for cache, words in (
        ({(0, 1): 1, (0, 2): 1, (0, 9): 1}, "never announced"),
        ({(0, 1): 1}, "no longer holds"),
        ({(0, 1): 1, (0, 2): 2}, "holds 2"),
    ):
        again = StreamJudge()
        again.feed(CLEAN[0])
        found = again.boundary(cache)
        assert found is not None and found.invariant == "ViewEqualsCache", cache
        assert words in found.sentence


def test_an_announced_block_that_will_never_hold_its_prefix() -> None:
    """The engine's block 5 carries hash 2's prefix (1, 2, 3, 4) but holds garbage."""
    judge = StreamJudge(keep_prefixes=True)
    judge.feed(CLEAN[0])
    blocks = {("GPU", 0, 1): (4,), ("GPU", 0, 2): (5,)}
    prefixes: list[tuple[int, ...]] = []

    def bad(prefix: tuple[int, ...], ids: object) -> tuple[int, ...]:
        prefixes.append(prefix)
        return (5,) if prefix == (1, 2, 3, 4) else ()

    found = judge.boundary(blocks_of=lambda key: blocks.get(key, ()), bad_blocks=bad)
    assert found is not None and found.invariant == "AnnouncedHoldsPrefix" and found.blocks == (5,)
    assert sorted(prefixes) == [(1, 2), (1, 2, 3, 4)]
    report = judge.report("x")
    assert report.exit_code == 1 and report.invariant == "AnnouncedHoldsPrefix"


def test_reports_carry_the_minimal_history_of_the_hashes_involved() -> None:
    judge = StreamJudge()
    for batch in (CLEAN[0], CLEAN[1], Batch(2, (removed(3),))):
        judge.feed(batch, line=batch.seq + 10)
    report = judge.report("cap.jsonl")
    assert report.exit_code == 1 and report.line == 12
    texts = [text for _, text in report.history]
    assert any("BlockStored [0x3]" in t for t in texts) and any(
        "BlockRemoved [0x3]" in t for t in texts
    )
    assert all("[0x1, 0x2]" not in t for t in texts)  # not about hash 3
    assert report.timeline and {kind for _, _, kind, _ in report.timeline} >= {
        "publish",
        "unpublish",
    }


def test_every_invariant_has_a_sentence() -> None:
    for name in s.INVARIANTS:
        assert s.sentence(name).endswith("."), name


def test_what_holds_per_group_kind_and_for_placeholders() -> None:
    """A sliding-window group's parent may be a block that fell out of the window (never
    stored); vLLM's offloading connector may announce a hash without its tokens."""
    window = stored((3,), 2, (5, 6), kind="sliding_window")
    full = stored((3,), 2, (5, 6), kind="full_attention")
    placeholder = Stored((4,), None, (), 0, "CPU", 0)
    assert judge_all([Batch(0, (window, placeholder))]) == (None, None)
    assert judge_all([Batch(0, (full,))]) == ("ParentAnnounced", 0)
    assert judge_all([Batch(0, (Stored((4,), None, (), 2, "CPU", 0),))]) == ("StoreConsistent", 0)


def test_after_a_clear_a_skipped_parent_is_judged_only_in_full_attention_groups() -> None:
    """vLLM's Mamba group after a reset: the block before the one it keeps is a null block it
    skipped, whose hash the clear dropped; the full group names that parent having stored it
    anew, the Mamba group does not store it (``ClearEmptiesView``'s child rule is asked of
    ``CHAINED_KINDS`` only, as ``ParentAnnounced``)."""
    before = Batch(0, (stored((1,), None, (1, 2), group=1, kind="mamba"),))
    mamba = stored((2,), 1, (3, 4), group=1, kind="mamba")
    full = stored((2,), 1, (3, 4), group=0, kind="full_attention")
    assert judge_all([before, Batch(1, (Cleared(), mamba))]) == (None, None)
    before_full = Batch(0, (stored((1,), None, (1, 2), group=0, kind="full_attention"),))
    assert judge_all([before_full, Batch(1, (Cleared(), full))]) == ("ClearEmptiesView", 1)
    removal = removed(1, group=1)
    assert judge_all([before, Batch(1, (Cleared(), removal))]) == ("ClearEmptiesView", 1)
