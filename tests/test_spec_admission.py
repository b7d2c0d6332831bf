"""The spec's cache-aware admission rule (``spec/admission.py``, vLLM 0.34.0's
``cache_aware_admission_window``): a request whose prefix is cached is admitted ahead of one
that is not, inside the window and above the usage threshold, and only then; the queue's head
is otherwise admitted first. Planted: the rule sorting the shallowest prefix first (the
admission the rule allows is then Illegal)."""

from __future__ import annotations

import pytest

from kvspec.spec import Config, Illegal, apply, initial_state
from kvspec.spec import admission as spec_admission


def _warm(window: int, threshold: float) -> object:
    """r0 ran (its 4 tokens published, still running: usage above 0), then r1 (cold) and r2
    (r0's prefix) wait, r1 first."""
    s = initial_state(
        Config(8, 2, admission_window=window, admission_threshold=threshold, max_running=4)
    )
    for event in (
        ("arrive", 0, (1, 2, 3, 4, 5), 4, 0),
        ("begin", 0),
        ("schedule", 0, 5, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ((0, 9),)),
        ("arrive", 1, (7, 7, 7, 7, 7), 4, 0),
        ("arrive", 2, (1, 2, 3, 4, 6), 4, 0),
        ("begin", 1),
        ("schedule", 0, 1, 0),
    ):
        apply(s, event)
    return s


def test_a_cached_prefix_is_admitted_first_above_the_threshold() -> None:
    s = _warm(2, 0.0)
    apply(s, ("schedule", 2, 1, 0))  # r2 hits r0's 4 tokens: admitted before r1
    with pytest.raises(Illegal, match="head of the waiting queue"):
        apply(_warm(2, 0.0), ("schedule", 1, 5, 0))


@pytest.mark.parametrize("window, threshold", [(0, 0.0), (1, 0.0), (2, 1.0)])
def test_queue_order_outside_the_rule(window: int, threshold: float) -> None:
    """Off, a window of one, or usage below the threshold: the head (r1) first."""
    apply(_warm(window, threshold), ("schedule", 1, 5, 0))
    with pytest.raises(Illegal, match="head of the waiting queue"):
        apply(_warm(window, threshold), ("schedule", 2, 1, 0))


def test_a_preempted_request_keeps_its_place() -> None:
    s = _warm(3, 0.0)
    s.requests[1].preempted = True  # as after a preemption: not moved, nothing moved past it
    assert spec_admission.reordered(s) is None


def test_a_rule_sorting_the_wrong_way_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: shallowest prefix first. The rule's own admission (r2) becomes Illegal."""
    real = spec_admission.cached_tokens
    monkeypatch.setattr(spec_admission, "cached_tokens", lambda s, rid: -real(s, rid))
    with pytest.raises(Illegal, match="head of the waiting queue"):
        apply(_warm(2, 0.0), ("schedule", 2, 1, 0))


def test_a_trace_with_cache_aware_admission_round_trips_and_is_checked(tmp_path) -> None:
    """The header carries both fields; ``kvspec check`` judges the trace by the spec (0), the
    same events under queue order are a finding (1), a threshold that is not a number is bad
    input (2)."""
    import json

    from kvspec.cli import main
    from kvspec.conformance.trace import read_trace, write_trace

    config = Config(8, 2, admission_window=2, admission_threshold=0.0, max_running=4)
    events = [
        ("arrive", 0, (1, 2, 3, 4, 5), 4, 0),
        ("begin", 0),
        ("schedule", 0, 5, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ((0, 9),)),
        ("arrive", 1, (7, 7, 7, 7, 7), 4, 0),
        ("arrive", 2, (1, 2, 3, 4, 6), 4, 0),
        ("begin", 1),
        ("schedule", 0, 1, 0),
        ("schedule", 2, 1, 0),
    ]
    path = tmp_path / "admission.jsonl"
    state, full = initial_state(config), []
    for event in events:
        full += [event, *apply(state, event)]
    write_trace(path, config, full)
    assert read_trace(path)[0] == config
    assert main(["check", str(path)]) == 0
    plain = tmp_path / "plain.jsonl"
    write_trace(plain, Config(8, 2, max_running=4), full)
    assert main(["check", str(plain)]) == 1
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["model"]["admission_threshold"] = "high"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert main(["check", str(bad)]) == 2
