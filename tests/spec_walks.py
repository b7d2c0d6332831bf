"""Random walks of the spec itself: traces of any configuration the spec has (async scheduling,
delivered stale output, draft tokens and deferred frees included), for the tests that hold a twin equal to the spec where no
engine produces such traces yet.

``spec_runs()`` draws a configuration and walks it: at each step it draws a decision kind and its
arguments from the state (which request, how many tokens, which loads fail, which tokens are
sampled), keeps it if the spec takes it (tried on a copy) and records the decision with the
effects the spec computes, as a conforming engine would emit them. The draws are Hypothesis's,
so failing walks shrink.
"""

from __future__ import annotations

import copy

from hypothesis import strategies as st

from kvspec.spec import POLICIES, Config, Illegal, apply, initial_state
from kvspec.spec.events import Event
from kvspec.spec.policies import eager
from kvspec.spec.pool import lookup
from kvspec.spec.state import State

EAGER = tuple(name for name, traits in POLICIES.items() if eager(traits))
"""The unsafe policies (publish at schedule), drawn twice as often."""

KINDS = (
    *("arrive",) * 2,
    *("build",) * 4,
    *("schedule",) * 2,
    "preempt",
    *("step",) * 3,
    "abort",
    "reset",
)


@st.composite
def spec_configs(draw: st.DrawFn, drafts: bool = True, window: bool = False) -> Config:
    """``drafts``: configurations may have draft tokens (``spec_tokens``), synchronous or under
    async scheduling, and any may defer its frees (``defer_free``) and its loads with them
    (``defer_loads``); off for the fast model, which refuses both. ``window``: every
    configuration has a sliding window (``sliding_window``) and the safe registration policy
    (``deferred``)."""
    async_scheduling = draw(st.booleans())
    depth = draw(st.integers(2 if async_scheduling else 1, 3))
    spec_tokens = draw(st.sampled_from((0, 0, 1, 3))) if drafts else 0
    defer_free = draw(st.booleans()) if drafts else False
    return Config(
        num_blocks=draw(st.integers(4, 8)),
        block_size=draw(st.sampled_from((1, 2, 4))),
        depth=depth,
        policy="deferred" if window else draw(st.sampled_from((*POLICIES, *EAGER))),
        discipline=draw(st.sampled_from(("vllm", "general", "general"))),
        preemption=draw(st.sampled_from(("fcfs", "priority"))),
        token_budget=draw(st.integers(3, 12)),
        max_running=draw(st.integers(2, 4)),
        stop_token=0,
        async_scheduling=async_scheduling,
        stale_output=draw(st.sampled_from(("drop", "deliver"))) if depth > 1 else "drop",
        prefix_caching=draw(st.sampled_from((True, True, True, False))),
        spec_tokens=spec_tokens,
        delay_load_registration=draw(st.booleans()),
        defer_free=defer_free,
        defer_loads=defer_free and draw(st.booleans()),
        sliding_window=draw(st.sampled_from((1, 2, 3, 5))) if window else None,
    )


def _try(s: State, decision: Event) -> list[Event] | None:
    trial = copy.deepcopy(s)
    try:
        apply(trial, decision)
    except Illegal:
        return None
    return apply(s, decision)


@st.composite
def spec_runs(
    draw: st.DrawFn, max_steps: int = 60, drafts: bool = True, window: bool = False
) -> tuple[Config, list[Event]]:
    """A configuration and a trace the spec accepts: decisions, each followed by its effects.
    With draft tokens a decode reaches some of its K draft slots, and its commit accepts some.
    ``window``: under a sliding window (``spec_configs``)."""
    config = draw(spec_configs(drafts, window))
    k = config.spec_tokens
    s = initial_state(config)
    events: list[Event] = []
    next_id = 0
    capacity = (config.num_blocks - 1) * config.block_size

    def take(decision: Event) -> bool:
        effects = _try(s, decision)
        if effects is None:
            return False
        events.append(decision)
        events.extend(effects)
        return True

    for _ in range(draw(st.integers(max_steps // 3, max_steps))):
        kind = draw(st.sampled_from(KINDS))
        building = s.building
        if kind == "arrive":
            max_tokens = draw(st.integers(1, 4))
            length = draw(st.integers(1, max(1, min(6, capacity - max_tokens))))
            vocab = st.sampled_from((1, 1, 1, 2)) if window else st.integers(1, 3)  # hits
            prompt = tuple(draw(st.lists(vocab, min_size=length, max_size=length)))
            take(("arrive", next_id, prompt, max_tokens, draw(st.integers(0, 2))))
            next_id += 1
        elif (
            kind == "build"
        ):  # an engine-like step: every running request to the end, one admission
            if building is None:
                if len(s.steps) >= config.depth or not take(("begin", s.next_step)):
                    continue
                building = s.building
            assert building is not None
            for rid in list(s.running):
                req = s.requests[rid]
                ahead = s.ahead(req) if config.async_scheduling else req.tokens
                if len(ahead) > req.computed:
                    more = len(ahead) - req.computed + draw(st.integers(0, k))
                    take(("schedule", rid, min(more, config.token_budget), 0))
            if s.waiting and draw(st.booleans()):
                rid = s.waiting[0]
                req, bsz = s.requests[rid], config.block_size
                loaded = (len(req.tokens) - 1) // bsz - len(lookup(s, req))
                loaded = loaded if loaded > 0 and draw(st.integers(0, 2)) == 0 else 0
                rest = len(req.tokens) - len(lookup(s, req)) * bsz - loaded * bsz
                take(("schedule", rid, min(rest, config.token_budget), loaded))  # sync if loaded
            take(("submit", building.id))
        elif kind in ("schedule", "preempt"):
            if building is None:
                if len(s.steps) < config.depth:
                    take(("begin", s.next_step))
                continue
            live = sorted(s.waiting) + sorted(s.running)
            if not live:
                take(("submit", building.id))
                continue
            rid = draw(st.sampled_from(live))
            if kind == "preempt":
                take(("preempt", rid))
            elif rid in s.waiting and draw(st.integers(0, 2)) == 0:  # an admission that loads:
                req, bsz = s.requests[rid], config.block_size  # asynchronously (no tokens; it
                cached = len(lookup(s, req))  # may end at the last token), or synchronously
                # (the rest, or 1, computed after); loads the spec refuses are not taken
                loaded = draw(st.integers(1, max(1, len(req.tokens) // bsz - cached)))
                rest = max(1, len(req.tokens) - (cached + loaded) * bsz)
                take(("schedule", rid, draw(st.sampled_from((0, 0, rest, 1))), loaded))
            else:
                req = s.requests[rid]
                ahead = s.ahead(req) if config.async_scheduling else req.tokens
                rest = max(1, len(ahead) - req.computed)  # to the end: a placeholder decode
                tokens = draw(st.sampled_from((rest, rest, 1, config.token_budget, rest + k)))
                take(("schedule", rid, tokens, 0))
        elif kind == "step":
            if building is not None:
                take(("submit", building.id))
                continue
            unexecuted = next((st_ for st_ in s.steps if st_.phase == "submitted"), None)
            if unexecuted is not None and (not s.steps or draw(st.booleans())):
                loads = [r for r, e in unexecuted.entries.items() if e.load]
                failed = tuple(r for r in loads if draw(st.integers(0, 2)) == 0)
                take(("execute", unexecuted.id, failed))
            elif s.steps and s.steps[0].phase == "executed":
                first = s.steps[0]
                sampled = tuple(
                    (rid, draw(st.integers(0, 3)))
                    for rid, e in first.entries.items()
                    if e.samples and rid in first.live
                    for _ in range(1 + draw(st.integers(0, e.drafts)))  # accepted drafts
                )
                take(("commit", first.id, sampled))
            elif len(s.steps) < config.depth:
                take(("begin", s.next_step))
        elif kind == "abort" and building is None:
            live = sorted(s.waiting) + sorted(s.running)
            if live:
                take(("abort", draw(st.sampled_from(live))))
        elif kind == "reset" and building is None:
            take(("reset",))
    return config, events
