"""What the window-beside-a-connector spec tests share (``test_spec_window_load.py``: a load at
an admission under a window; ``test_spec_window_finish.py``: a finish that trims first): a
window of 4 over blocks of 4, a 14-token prompt, and a run that checks every invariant after
each event."""

from __future__ import annotations

from kvspec.spec import Config, apply, check
from kvspec.spec.state import State

PROMPT = tuple(range(1, 15))  # 14 tokens: three full blocks of 4 and two


def window_config(**kw: object) -> Config:
    base: dict[str, object] = dict(
        num_blocks=12, block_size=4, depth=1, sliding_window=4, policy="deferred"
    )
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def run_checked(s: State, events: list[tuple[object, ...]]) -> list[list[tuple[object, ...]]]:
    """Apply each event, every invariant holding after it; the effects of each."""
    out = []
    for event in events:
        out.append(apply(s, event))
        assert check(s) is None, (event, check(s))
    return out
