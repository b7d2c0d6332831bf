"""Adapter mistakes are bad input, not engine bugs (``conformance/protocol.py``): a planted
mistake in an adapter of the reference engine (``snapshot()`` returning lists, a ``publish`` event
with an extra field, a hit's blocks as a list, an unknown kind) is exit 2 naming the method and
the field, from ``kvspec adapter-check`` and from ``kvspec fuzz --target`` alike; never a
finding. The reference adapter itself passes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from edges import one_line, run

from kvspec.conformance.adapter import ReferenceAdapter, reference
from kvspec.conformance.protocol import ProtocolError, check_adapter, check_event
from kvspec.spec import Config

CONFIG = Config(num_blocks=8, block_size=4, policy="deferred", stop_token=0)

MISTAKES = """
from kvspec.conformance.adapter import ReferenceAdapter


class ListSnapshot(ReferenceAdapter):
    def snapshot(self):
        refcounts, free = super().snapshot()
        return list(refcounts), list(free)


class PublishWithHash(ReferenceAdapter):
    def step(self):
        start = len(self.events)
        busy = super().step()
        for i in range(start, len(self.events)):
            if self.events[i][0] == "publish":
                self.events[i] = self.events[i] + ("a1b2",)
        return busy


def list_snapshot(config, choices):
    return ListSnapshot(config, choices)


def publish_with_hash(config, choices):
    return PublishWithHash(config, choices)
"""


@pytest.fixture
def mistakes(tmp_path: Path) -> Path:
    (tmp_path / "mistakes.py").write_text(MISTAKES)
    return tmp_path


def test_the_reference_adapter_follows_the_protocol() -> None:
    assert check_adapter(reference, CONFIG) > 20


@pytest.mark.parametrize(
    ("event", "named"),
    [
        (["free", 3], "is a list, not a tuple"),
        (("publish", 0, 0, 3, "a1b2"), "a publish has 3 fields (req, index, block), this one 4"),
        (("hit", 0, [1, 2]), "field blocks: a list, not a tuple"),
        (("alloc", 0, 9), "field block: block 9 is outside 0..7"),
        (("free", True), "field block: True (bool) is not a block id"),
        (("freed", 3), "unknown kind"),
        (("finish", 0, "done"), "field reason: 'done' is not one of"),
        (("alloc", 0, 3, 0), "field group: 0 is not an int >= 1"),
        (("free", 3, 1), "a free has 1 fields (block), this one 2"),
    ],
)
def test_an_event_outside_the_vocabulary_is_named(event: object, named: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        check_event(event, 8, "step()")
    assert named in str(caught.value) and str(caught.value).startswith("step(): ")


def test_an_event_of_a_group_above_0_carries_its_group_last() -> None:
    for event in (
        ("alloc", 0, 3, 1),
        ("hit", 0, (), 2),
        ("publish", 0, 0, 3, 1),
        ("dedup", 0, 0, 3, 1),
    ):
        check_event(event, 8, "step()")


def test_a_snapshot_of_lists_names_the_method_and_the_field() -> None:
    class ListSnapshot(ReferenceAdapter):
        def snapshot(self):  # type: ignore[no-untyped-def]
            refcounts, free = super().snapshot()  # type: ignore[misc]
            return list(refcounts), list(free)

    with pytest.raises(ProtocolError) as caught:
        check_adapter(ListSnapshot, CONFIG)
    assert str(caught.value) == "snapshot(): refcounts is a list, not a tuple"


@pytest.mark.parametrize(
    ("factory", "named"),
    [
        ("list_snapshot", "snapshot(): refcounts is a list, not a tuple"),
        ("publish_with_hash", "step(): emitted: event ('publish', 0, 0, "),
    ],
)
@pytest.mark.parametrize("command", ["adapter-check", "fuzz"])
def test_a_planted_adapter_mistake_is_bad_input_never_a_finding(
    mistakes: Path, factory: str, named: str, command: str
) -> None:
    argv = (
        [command, f"mistakes:{factory}"]
        if command == "adapter-check"
        else ["fuzz", "--policy", "deferred", "--target", f"mistakes:{factory}", "--seconds", "5"]
    )
    done = run(argv, cwd=mistakes)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert one_line(done.stderr) and named in done.stderr, done.stderr
    assert "counterexample" not in done.stdout
    if factory == "publish_with_hash":
        assert "a publish has 3 fields (req, index, block), this one 4" in done.stderr


def test_check_protocol_checks_every_call_of_every_run(mistakes: Path) -> None:
    """A mistake the check before the first run cannot see (an adapter that goes wrong on its
    tenth step) is caught on the way with ``--check-protocol``."""
    late = mistakes / "late.py"
    late.write_text(
        "from kvspec.conformance.adapter import ReferenceAdapter\n"
        "class Late(ReferenceAdapter):\n"
        "    steps = 0\n"
        "    def step(self):\n"
        "        Late.steps += 1\n"
        "        busy = super().step()\n"
        "        if Late.steps > 400 and busy:\n"
        "            self.events.append(['commit', 0, ()])\n"
        "        return busy\n"
        "def late(config, choices):\n"
        "    return Late(config, choices)\n"
    )
    argv = ["fuzz", "--policy", "deferred", "--target", "late:late", "--seconds", "10"]
    done = run([*argv, "--check-protocol", "--no-shrink"], cwd=mistakes)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "step(): emitted: event ['commit', 0, ()] is a list, not a tuple" in done.stderr


assert sys  # (the subprocess runs python -m kvspec from the test's interpreter)
