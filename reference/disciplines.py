"""Scheduling disciplines: which decisions build one step.

* ``schedule_vllm``: vLLM 0.33.0 ``Scheduler.schedule()``, deterministic. Running requests first,
  in order; one that cannot get its blocks preempts a victim (fcfs: the tail of ``running``;
  priority: the max ``(priority, arrival)`` over all running requests, possibly one already
  scheduled in this step) and retries; if it preempted itself, the running loop ends (as in
  vLLM); with deferred freeing a victim whose blocks would only be freed later ends it too.
  Then, only if nothing was preempted, waiting requests are admitted from the head until
  one does not fit, skipping (as vLLM does) those still waiting for their stale output.
  Under async scheduling a running request is scheduled up to ``Scheduler.schedulable_end``
  (its known tokens plus its placeholders).
* ``schedule_general``: what a third-party scheduler may do, driven by ``Choices`` (see
  ``choices.py`` for the labels): admissions before, between and after running requests,
  admissions of any waiting request, preemption of any running request.
"""

from __future__ import annotations

from collections.abc import Callable

from .block_pool import Block
from .choices import Choices
from .request import Request, Step
from .scheduler import Scheduler, WaitingQueue

RUN, ADMIT, SUBMIT, PREEMPT = "run", "admit", "submit", "preempt"


def plan_admission(
    sched: Scheduler, req: Request, budget: int
) -> tuple[list[Block], int, int, bool]:
    """(hits, tokens to compute, blocks to load, fits) for admitting ``req`` now. An external
    request whose store holds more full prompt blocks than the prefix cache loads them instead
    of computing anything, or with ``sync_loads`` computes the rest of its prompt after them in
    the same step."""
    kv = sched.kv
    bsz = kv.block_size
    hits = kv.lookup(req)
    num_hits = kv.hit_length(hits) // bsz
    num_loaded = 0
    if req.external and kv.window is None and not kv.grouped:  # loads not modelled there
        cfg = sched.config
        whole = cfg.load_last_block and not cfg.sync_loads and bsz > 1  # spec.actions.loadable
        stored = min(req.prompt_len // bsz, (len(req.tokens) - (0 if whole else 1)) // bsz)
        if stored > num_hits:
            num_loaded = stored - num_hits
    if num_loaded and sched.config.sync_loads:  # the rest of the prompt computed after it
        num_tokens = min(len(req.tokens) - stored * bsz, budget)
        end = stored * bsz + num_tokens
    elif num_loaded:
        num_tokens = 0
        end = stored * bsz
    else:
        num_tokens = sched.clip(req, num_hits * bsz, min(len(req.tokens) - num_hits * bsz, budget))
        end = num_hits * bsz + num_tokens
    return hits, num_tokens, num_loaded, not kv.blocks_short(req, end, hits)


def schedule_vllm(sched: Scheduler, step: Step) -> None:
    cfg = sched.config
    token_budget = cfg.token_budget
    running = sched.running
    by_priority = cfg.preemption == "priority"
    end_of = sched.schedulable_end
    i = 0
    while i < len(running):
        budget = token_budget - step.budget_used
        if budget <= 0:
            break
        req = running[i]
        limit = end_of(req)
        if req.loading is not None or req.computed >= limit:
            i += 1
            continue
        num_tokens = sched.clip(req, req.computed, min(limit - req.computed, budget))
        end = req.computed + num_tokens
        gave_up = False
        while sched.blocks_short(req, end):
            if by_priority:
                victim = max(running, key=_rank)
                position = running.index(victim)
            else:
                victim, position = running[-1], len(running) - 1
            if sched.frees_later(victim):  # vLLM: a deferred free will not help now
                gave_up = True
                break
            sched.preempt(victim)
            if victim is req:
                gave_up = True
                break
            if position < i:
                i -= 1
        if gave_up:
            break
        sched.schedule_running(step, req, num_tokens)
        i += 1
    if step.preempted:
        return
    waiting, held = sched.waiting, sched.held
    while len(waiting) > len(held) and len(running) < cfg.max_running:
        budget = token_budget - step.budget_used
        if budget <= 0:
            break
        head = waiting.head() if not held else _first_admissible(waiting, held)
        assert head is not None
        hits, num_tokens, num_loaded, fits = plan_admission(sched, head, budget)
        if not fits:
            break
        sched.admit(step, head, hits, num_tokens, num_loaded)


def schedule_general(sched: Scheduler, step: Step, choices: Choices) -> None:
    """Ask ``choices`` for moves until it submits (or a bound on the moves is reached). Each
    request is scheduled at most once per step; once an admission does not fit, no other is
    tried until a preemption frees blocks (this keeps a step O(running) for long queues).
    Requests waiting for their stale output (``Scheduler.held``) are not candidates."""
    cfg = sched.config
    running, waiting, held = sched.running, sched.waiting, sched.held
    end_of = sched.schedulable_end
    done: set[int] = set()  # scheduled, or given up on, in this step
    done_waiting: set[int] = set()  # those of them now waiting: not admissible in this step
    admit_blocked = False
    limit = 2 * (len(running) + len(waiting)) + 2
    for _ in range(limit):
        budget = cfg.token_budget - step.budget_used
        moves = []
        nxt = _next_running(running, done, end_of) if budget > 0 else None
        if nxt is not None:
            moves.append(RUN)
        excluded = done_waiting | held if held else done_waiting
        num_candidates = len(waiting) - len(excluded)
        if not admit_blocked and budget > 0 and len(running) < cfg.max_running and num_candidates:
            moves.append(ADMIT)
        moves.append(SUBMIT)
        if running:
            moves.append(PREEMPT)
        move = moves[_pick(choices, len(moves), "general-action")]
        if move == SUBMIT:
            return
        if move == PREEMPT:
            _preempt(
                sched, running[_pick(choices, len(running), "general-victim")], done, done_waiting
            )
            admit_blocked = False
        elif move == RUN:
            assert nxt is not None
            done.add(nxt.rid)
            num_tokens = sched.clip(nxt, nxt.computed, min(end_of(nxt) - nxt.computed, budget))
            end = nxt.computed + num_tokens
            while sched.blocks_short(nxt, end):
                victims = [r for r in reversed(running) if r is not nxt]
                k = _pick(choices, len(victims) + 1, "general-victim") if victims else 0
                if k == len(victims):
                    break
                _preempt(sched, victims[k], done, done_waiting)
                admit_blocked = False
            else:
                sched.schedule_running(step, nxt, num_tokens)
        else:
            k = _pick(choices, num_candidates, "general-admit")
            req = _kth_candidate(waiting, excluded, k)
            done.add(req.rid)
            while True:
                hits, num_tokens, num_loaded, fits = plan_admission(sched, req, budget)
                if fits:
                    sched.admit(step, req, hits, num_tokens, num_loaded)
                    break
                victims = list(reversed(running))
                k = _pick(choices, len(victims) + 1, "general-victim") if victims else 0
                if k == 0:
                    done_waiting.add(req.rid)
                    admit_blocked = True
                    break
                _preempt(sched, victims[k - 1], done, done_waiting)
                budget = cfg.token_budget - step.budget_used


def _preempt(sched: Scheduler, victim: Request, done: set[int], done_waiting: set[int]) -> None:
    sched.preempt(victim)
    if victim.rid in done:
        done_waiting.add(victim.rid)


def _kth_candidate(waiting: WaitingQueue, excluded: set[int], k: int) -> Request:
    """The k-th waiting request in admission order, skipping ``excluded``."""
    for req in waiting.in_order():
        if req.rid not in excluded:
            if k == 0:
                return req
            k -= 1
    raise IndexError(k)


def _first_admissible(waiting: WaitingQueue, held: set[int]) -> Request | None:
    """The first waiting request in admission order that is not held for its stale output."""
    for req in waiting.in_order():
        if req.rid not in held:
            return req
    return None


def _next_running(
    running: list[Request], done: set[int], end_of: Callable[[Request], int]
) -> Request | None:
    for req in running:
        if req.rid not in done and req.loading is None and req.computed < end_of(req):
            return req
    return None


def _pick(choices: Choices, n: int, label: str) -> int:
    return choices.pick(n, label) if n > 1 else 0


def _rank(req: Request) -> tuple[int, int]:
    return (req.priority, req.arrival)
