"""Known engine findings read by name (``conformance/kvevents/known_findings.py``): vLLM's Mamba
``align`` store with more tokens than hashes is ``StoreConsistent`` by default, and with
``known=("vllm-mamba-store-tokens",)`` each hash is read as the full-attention group's block,
counted and named in the report, while everything else stays judged; a store that cannot be
read that way is still reported."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.conformance.kvevents.frames import Frame, encode_batch, write_capture
from kvspec.conformance.kvevents.known_findings import KNOWN, MAMBA_STORE_TOKENS, Known
from kvspec.conformance.kvevents.stream_judge import StreamJudge
from kvspec.spec.stream import Batch, Cleared, Removed, Stored

FULL, MAMBA = dict(group=0, kind="full_attention"), dict(group=1, kind="mamba")


def stored(hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...], **kw: object) -> Stored:  # fmt: skip
    return Stored(hashes, parent, tokens, 2, "GPU", **kw)  # type: ignore[arg-type]


# vLLM's shape (tests/kv_stream_hybrid_checks.py mamba, depth 1): the full group stores blocks
# 10 and 11, the Mamba group keeps only 11 but lists the tokens of both.
SPARSE = Batch(
    0,
    (
        stored((10, 11), None, (1, 2, 3, 1), **FULL),
        stored((11,), None, (1, 2, 3, 1), **MAMBA),
    ),
)


def judge_all(batches: list[Batch], **options: object) -> StreamJudge:
    judge = StreamJudge(**options)  # type: ignore[arg-type]
    for batch in batches:
        if judge.feed(batch) is not None:
            break
    return judge


def test_the_default_reports_the_finding() -> None:
    judge = judge_all([SPARSE])
    assert judge.finding is not None and judge.finding.invariant == "StoreConsistent"
    assert "1 hashes of block size 2 but 4 tokens" in judge.finding.sentence


def test_known_reads_each_hash_as_the_full_groups_block_and_judges_the_rest() -> None:
    after = Batch(1, (Removed((11,), "GPU", 1), Removed((11,), "GPU", 1)))
    judge = judge_all([SPARSE, after], known=[MAMBA_STORE_TOKENS])
    # the rest is judged: the second removal of 11 in the Mamba group names nothing announced
    assert judge.finding is not None and judge.finding.invariant == "RemovalNamesAnnounced"
    assert judge.known.seen[MAMBA_STORE_TOKENS] == 1
    judge = judge_all([SPARSE, Batch(1, (Removed((11,), "GPU", 1),))], known=[MAMBA_STORE_TOKENS])
    assert judge.finding is None and judge.view is not None
    assert (("GPU", 1, 11)) not in judge.view.blocks and ("GPU", 0, 11) in judge.view.blocks
    judge = judge_all([SPARSE], known=[MAMBA_STORE_TOKENS])
    block = judge.view.blocks[("GPU", 1, 11)]  # type: ignore[union-attr]
    assert (block.parent, block.tokens) == (10, (3, 1))
    report = judge.report("x")
    assert report.exit_code == 0 and report.note is not None
    assert f"known finding {MAMBA_STORE_TOKENS} met 1 times, first in batch 0" in report.note


@pytest.mark.parametrize(
    "mamba",
    [
        stored((12,), None, (1, 2, 3, 1), **MAMBA),  # a hash no full group announced
        stored((11,), None, (1, 2, 9, 9), **MAMBA),  # the full group's tokens are not in the span
        stored((11,), 7, (3, 1, 5, 5), **MAMBA),  # [3, 1] only at the start, but 11's parent is 10
    ],
)
def test_a_store_that_cannot_be_read_soundly_is_still_reported(mamba: Stored) -> None:
    batch = Batch(0, (SPARSE.events[0], mamba))
    judge = judge_all([batch], known=[MAMBA_STORE_TOKENS])
    assert judge.finding is not None and judge.finding.invariant == "StoreConsistent"
    assert not judge.known.seen


def test_a_repeated_chunk_is_placed_where_its_parent_says() -> None:
    """The span [2, 1, 2, 1]: block 21 (tokens [2, 1], parent 20) is the second chunk, not the
    first, whose parent would be the store's (None)."""
    full = stored((20, 21), None, (2, 1, 2, 1), **FULL)
    mamba = stored((21,), None, (2, 1, 2, 1), **MAMBA)
    judge = judge_all([Batch(0, (full, mamba)), Batch(1, (Cleared(),))], known=[MAMBA_STORE_TOKENS])
    assert judge.finding is None and judge.known.seen[MAMBA_STORE_TOKENS] == 1


def test_only_known_names_are_taken() -> None:
    assert set(KNOWN) == {MAMBA_STORE_TOKENS}
    with pytest.raises(ValueError, match="unknown known finding"):
        Known(["vllm-something-else"])


def test_kvspec_check_reports_it_by_default_and_reads_it_with_known(tmp_path: Path) -> None:
    capture = tmp_path / "mamba.jsonl"
    write_capture(capture, [Frame("pub", 0, b"", encode_batch(SPARSE))], "loopback", None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["check", "--kv-events", str(capture)]) == 1
    assert "StoreConsistent" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["check", "--kv-events", str(capture), "--known", MAMBA_STORE_TOKENS]) == 0
    assert f"known finding {MAMBA_STORE_TOKENS} met 1 times" in out.getvalue()
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["check", "--kv-events", str(capture), "--known", "nonsense"]) == 2


@pytest.mark.parametrize(("known", "code"), [((), 1), ((MAMBA_STORE_TOKENS,), 0)])
def test_kvspec_watch_reads_it_live_only_when_told(
    known: tuple[str, ...], code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvspec watch --known``: the same reading as ``check``, live (the stand-in publisher of
    ``tests/test_kv_events.py``)."""
    pytest.importorskip("zmq")
    from test_kv_events import StandIn

    from kvspec.conformance.kvevents.watch import watch

    stand_in = StandIn()

    def feed() -> None:
        stand_in.wait_subscribed()
        time.sleep(0.2)  # the initial replay has ended
        stand_in.send(SPARSE)

    sender = threading.Thread(target=feed)
    sender.start()
    try:
        got = watch(stand_in.endpoint, stand_in.replay, seconds=2, out=print, known=known)
    finally:
        sender.join()
        stand_in.close()
    out = capsys.readouterr().out
    assert got == code, out
    assert ("StoreConsistent" in out) == (code == 1), out
