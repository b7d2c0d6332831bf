"""Preemptions and resets: the part of ``Attachment`` (``attach.py``) that wraps
``Scheduler._preempt_request`` and both ``reset_prefix_cache`` (the scheduler's and the KV-cache
manager's).

A preemption inside ``schedule()`` is one of its decisions; the caller's own, between a
``schedule()`` and its output, is a step of its own to the spec (``_lone_preemption``), and so
is a reset that preempts the running requests (``_reset_step``; beside steps in flight the spec's
``("reset", True)`` inside that step, which drops the victims' output in flight as vLLM's
``drop_stale_output=True`` does). Beside an asynchronous load the
spec and vLLM rank running requests differently: ``_victim_beside_loads`` judges where their
victims agree. The attachment's state lives in ``Attachment``; this class only groups its
methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import Request

from .attach_steps import InFlight
from .features import pending_features, scheduler_features
from .methods import Method


@dataclass(frozen=True)
class _Empty:
    """The output of a step the attachment made for the caller's own preemption: no tokens."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


_EMPTY = _Empty()


class Preemptions:
    """``Attachment``'s wrappers of preemptions and resets."""

    def _scheduler_reset(self, original: Method) -> Method:
        def reset_prefix_cache(*args: Any, **kw: Any) -> Any:
            running = kw.get("reset_running_requests", args[0] if args else False)

            def body() -> Any:
                if running and self.scheduler.running:
                    self._safe(self._reset_step)
                try:
                    return original(*args, **kw)
                finally:
                    self._safe(self._close_reset_step)

            return self._outermost("reset_prefix_cache", body)

        return reset_prefix_cache

    def _reset_step(self) -> None:
        """``reset_prefix_cache(reset_running_requests=True)`` preempts every running request,
        the tail of ``running`` first, then resets the cache. To the spec that is a step of
        its own: ``begin``, the preemptions (vLLM's ``_preempt_request``, wrapped), then, with
        no step in flight, ``submit``, ``execute`` and ``commit`` of an empty batch before the
        ``reset`` (``_close_reset_step``); beside steps in flight, ``("reset", True)`` in that
        step (vLLM drops the victims' output in flight whatever its mode, and so does the
        spec's rule), then its ``submit``: its empty batch executes and commits after the
        steps before it (``_commit``). Under the priority policy judged where the tail of
        ``running`` is always its largest (priority, arrival), the spec's victim; refused where
        the victims' frees would be deferred (vLLM's reset then fails and raises)."""
        running = list(self.scheduler.running)
        if self.in_flight:
            if self.config.defer_free:
                self.refuse(
                    "reset preempting running requests", "frees deferred by steps in flight"
                )
            if len(self.in_flight) >= self.config.depth:
                self.refuse("reset preempting running requests", "no room for its step")
            self._in_flight_counts(running)
        if self.config.preemption == "priority":
            ranks = [(r.priority, self.ids.get(r.request_id, -1)) for r in running]
            if ranks != sorted(ranks):
                self.refuse("reset preempting running requests", "not in priority order")
        self._victims = [r.request_id for r in running]
        step = self.next_step
        self.next_step += 1
        self._reset_at = step
        self.events.append(("begin", step))

    def _in_flight_counts(self, running: list[Request]) -> None:
        """A request's ``num_in_flight_tokens`` is the tokens the steps in flight schedule for it
        (counted at ``schedule()``, drained at each output). One the caller set otherwise (vLLM's
        ``test_scheduler_reset_prefix_cache`` zeroes them for a step whose output it never
        processes) changes nothing of the reset the spec models: the preemptions, their frees
        and the unpublishing read no count, and the victims' output in flight is dropped
        whatever the count says. It matters only to that output's processing later, where
        vLLM drains the stale share by the count: so the reset is judged and every entry point
        after it refused as the edit it is (``_edited``)."""
        for request in running:
            counted = sum(
                f.output.num_scheduled_tokens.get(request.request_id, 0) for f in self.in_flight
            )
            if request.num_in_flight_tokens != counted:
                self._edited = (
                    f"{request.request_id}'s num_in_flight_tokens {request.num_in_flight_tokens}, "
                    f"its steps in flight schedule {counted}"
                )
                return

    def _dropped_by_reset(self) -> set[str]:
        """The requests whose output in flight a reset beside steps in flight dropped and whose
        dropped share vLLM has not drained yet (``num_stale_output_tokens``): their stale output
        is dropped whatever the scheduler's mode, as the spec's rule drops it (a preemption
        while the share is undrained keeps dropping, vLLM's and the spec's alike)."""
        requests = self.scheduler.requests
        self._dropped = {
            r for r in self._dropped if r in requests and requests[r].num_stale_output_tokens > 0
        }
        return self._dropped

    def _close_reset_step(self) -> None:
        step, self._reset_at = self._reset_at, None
        if step is None:
            return
        self.events.append(("submit", step))
        if self.in_flight:  # it executes and commits after the steps before it (_commit)
            self.in_flight.append(InFlight(step, _EMPTY, {}))
        else:
            self.events += [("execute", step, ()), ("commit", step, ())]

    def _kv_reset(self, original: Method) -> Method:
        def reset_prefix_cache(*args: Any, **kw: Any) -> bool:
            def body() -> bool:
                beside = self._reset_at is not None and bool(self.in_flight)
                if not beside:
                    self._close_reset_step()  # the preemptions' step ends before the reset
                cached = sorted(b.block_id for b in self.pool.blocks if b.block_hash is not None)
                try:
                    done = bool(original(*args, **kw))
                    if done:
                        if beside:  # in the reset's own step, beside the steps in flight
                            self.events.append(("reset", True))
                            self._dropped.update(self._victims)
                        elif self.in_flight:
                            self.refuse(
                                "reset with steps in flight", f"{len(self.in_flight)} steps"
                            )
                        else:
                            self.events.append(("reset",))
                        self.events.extend(("unpublish", block) for block in cached)
                finally:
                    if beside:
                        self._close_reset_step()
                return done

            return self._outermost("reset_prefix_cache", body)  # type: ignore[no-any-return]

        return reset_prefix_cache

    def _preempt_request(self, original: Method) -> Method:
        def preempt(request: Request, *args: Any, **kw: Any) -> None:
            if self.depth == 0:  # the test's own preemption: a step of its own, or refused
                self._safe(self._lone_preemption, request)
                try:
                    return self._record_preempt(original, request, *args, **kw)
                except BaseException as err:
                    self.refuse("vLLM raised", f"{type(err).__name__} in _preempt_request()")
                    raise
                finally:
                    self._safe(self._close_lone_preemption)
            if self.entry != "schedule" and self._reset_at is None:
                self.refuse("preemption outside schedule()", f"in {self.entry}")
            return self._record_preempt(original, request, *args, **kw)

        return preempt

    def _record_preempt(self, original: Method, request: Request, *args: Any, **kw: Any) -> None:
        if self.loads.alive:  # the spec runs a loading request, vLLM keeps it waiting
            self._safe(self._victim_beside_loads, request)
        rid = self.ids.get(request.request_id)
        self.events.append(("preempt", rid))
        self.on_preempt(request.request_id)
        original(request, *args, **kw)

    def _victim_beside_loads(self, victim: Request) -> None:
        """A preemption while a request admitted with an asynchronous load is alive. The spec
        runs such a request from its load's admission on; vLLM appends it to ``running`` only
        when it is scheduled after landing, so the two rank their running requests
        differently, and only the choice of a victim depends on that. By vLLM's rule the
        victim is the last appended to ``running`` (fcfs) or the largest (priority, arrival),
        of its running requests (the victim among them: vLLM has just taken it off); by the
        spec's, the last admitted or the largest of those and the loads not scheduled yet.
        Where the two rules pick one request the preemption is judged (a victim vLLM chose
        otherwise is the spec's to find); where they pick two, refused."""
        running = {r.request_id for r in self.scheduler.running} | {victim.request_id}
        candidates = running | self.loads.waiting
        if self.config.preemption == "priority":
            requests, ids = self.scheduler.requests, self.ids
            ranks = {r: (requests[r].priority, ids.get(r, -1)) for r in candidates}
            vllm_rule = max(running, key=ranks.__getitem__)
            spec_rule = max(candidates, key=ranks.__getitem__)
        else:
            vllm_rule = max(running, key=lambda r: self._appended.get(r, -1))
            spec_rule = max(candidates, key=lambda r: self._admitted.get(r, -1))
        if vllm_rule != spec_rule:
            self.refuse(
                "KV connector: preemption beside an asynchronous load",
                f"vLLM's rule preempts {vllm_rule}, the spec's {spec_rule}",
            )

    def _lone_preemption(self, request: Request) -> None:
        """The caller preempts a request itself, outside ``schedule()`` (vLLM's tests do, between
        a ``schedule()`` and its output: popping it from ``running``, then ``_preempt_request``,
        as ``schedule()`` does). To the spec that is a step of its own (``begin``, the
        ``preempt``, ``submit``; its empty batch executes and commits when the steps before it
        have, ``_commit``), which matches vLLM where the request popped is the one ``schedule()``
        would preempt: under fcfs the tail of ``running``, under the priority policy its
        largest (priority, arrival). Refused otherwise, where anything else changed since the
        last entry point, and where its free would be deferred (``defer_block_free`` with a
        step in flight: vLLM's ``schedule()`` never preempts such a request)."""
        self.depth, self.entry = 1, "_preempt_request"
        if self._held:
            self._release()
        if self.refusal is not None:
            return
        sched, rid = self.scheduler, request.request_id
        before, now = self._fingerprint, self.fingerprint()
        running = tuple(r.request_id for r in sched.running)
        was = before[1]
        if now[:1] + now[2:] != before[:1] + before[2:] or was[:-1] != running:
            if rid in was and tuple(r for r in was if r != rid) == running:
                return self.refuse("preemption outside schedule()", f"{rid}: not the tail")
            return self.refuse("state edited between calls", "before _preempt_request()")
        if not was or was[-1] != rid:
            return self.refuse("preemption outside schedule()", f"{rid} was not running")
        if self.config.preemption == "priority":
            ranks = [(r.priority, self.ids.get(r.request_id, -1)) for r in sched.running]
            mine = (request.priority, self.ids.get(rid, -1))
            if any(rank > mine for rank in ranks):
                return self.refuse("preemption outside schedule()", f"{rid}: not the largest")
        if self.config.defer_free and self.in_flight:
            return self.refuse("preemption outside schedule()", f"{rid}'s free deferred")
        for feature in scheduler_features(sched) + pending_features(
            sched,
            scheduling=False,
            loaders=self.loads.waiting,
            held=self._grammars,
            dropped=self._dropped_by_reset(),
        ):
            return self.refuse(*feature)
        step = self.next_step
        self.next_step += 1
        self._lone_at = step
        self.events.append(("begin", step))

    def _close_lone_preemption(self) -> None:
        step, self._lone_at = self._lone_at, None
        if step is not None:
            self.events.append(("submit", step))
            self.in_flight.append(InFlight(step, _EMPTY, {}))
        self._exit()
