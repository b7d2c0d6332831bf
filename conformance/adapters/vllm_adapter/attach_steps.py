"""Requests arriving and steps scheduled: the part of ``Attachment`` (``attach.py``) that wraps
``Scheduler.add_request``, ``schedule`` (with 0.34.0's cache-aware reorder and MTP's prefill
lookahead inside it) and records what a step submitted (``InFlight``).

A request arrives to the spec when vLLM adds it, unless it is held: under the priority policy
until the next other entry point, ordered by ``arrival_time`` (``hold_arrivals``), and while its
grammar compiles (``_release_grammars``). ``schedule()`` is a ``begin``, the decisions and
effects recorded inside it (``attach_blocks.py``), and a ``submit``. The attachment's state lives
in ``Attachment``; this class only groups its methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.request import Request, RequestStatus

from . import groups as hybrid_groups
from .features import grammar_ready, request_features
from .methods import Method

Event = tuple[object, ...]


@dataclass
class InFlight:
    """A step ``schedule()`` submitted whose output has not been processed yet."""

    step: int
    output: Any
    samples: dict[str, bool]
    """Request id -> whether its chunk reached the end of its known tokens (it samples)."""


class StepCalls:
    """``Attachment``'s wrappers of arrivals and ``schedule()``."""

    def _add_request(self, original: Method) -> Method:
        def add_request(request: Request, *args: Any, **kw: Any) -> None:
            self._outermost(
                "add_request",
                lambda: (self._safe(self._arrive, request), original(request, *args, **kw))[1],
            )

        return add_request

    def _arrive(self, request: Request) -> None:
        for feature in request_features(self.scheduler, request):
            self.refuse(*feature)
            if feature[0] == "streaming input" or request.prompt_token_ids is None:
                return
            break
        self._lookahead(request)
        self._check_hashes(request, len(request.block_hashes))
        room = self.scheduler.max_model_len - request.num_prompt_tokens
        max_tokens = min(request.max_tokens, room)
        prompt = tuple(request.prompt_token_ids)
        event: Event = ("arrive", None, prompt, max_tokens, request.priority)
        event += hybrid_groups.encoder_field(self.scheduler, request)  # cross-attention's
        if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and not (
            grammar_ready(request)
        ):
            self._grammars[request.request_id] = (request, event)
            return
        self._queue(request, event)

    def _queue(self, request: Request, event: Event) -> None:
        if self.config.preemption != "priority":
            return self._arrived(request, event)
        t, priority = request.arrival_time, request.priority
        latest = self._latest.get(priority)
        # vLLM ranks equal (priority, arrival_time) by request id, but picks its preemption
        # victim by (priority, arrival_time) alone: equal times are refused.
        tied = any(r.priority == priority and h == t for h, _, r, _ in self._held)
        if (latest is not None and t <= latest) or tied:
            self.refuse(
                "arrival times out of order",
                f"{request.request_id} arrives at {t}, after or beside one at {latest or t}",
            )
        if not (self.hold_arrivals and self.entry == "add_request"):  # not nested in another
            self._latest[priority] = t if latest is None else max(latest, t)
            return self._arrived(request, event)
        self._held.append((t, request.request_id, request, event))

    def _arrived(self, request: Request, event: Event) -> None:
        # An id vLLM has forgotten (its request finished) may come back: a new request to the
        # spec, so a new integer (the mapping names the latest).
        rid = self._next_id
        self._next_id += 1
        self.ids[request.request_id] = rid
        self.events.append((event[0], rid, *event[2:]))

    def _release(self) -> None:
        """The requests held since the last other entry point arrive, by ``arrival_time``
        (``hold_arrivals``): the spec's arrival order is then vLLM's rank among equal
        priorities. Nothing happened to them in vLLM meanwhile (``add_request`` only queues)."""
        held, self._held = sorted(self._held, key=lambda h: h[:2]), []
        for t, _, request, event in held:
            latest = self._latest.get(request.priority)
            self._latest[request.priority] = t if latest is None else max(latest, t)
            self._arrived(request, event)

    def _release_grammars(self) -> None:
        """A request waiting for its grammar is kept from the spec until the grammar is
        compiled: until then vLLM passes it over (``skip_request``) as if it were not there (it
        holds no block, counts toward no limit). Each pass puts the requests it passed over
        back at the head of ``waiting`` in their order, so under fcfs vLLM's queue then agrees
        with the spec's only where every request behind it is still kept from the spec too;
        under the priority policy it is ranked by ``arrival_time`` like any arrival (``_queue``
        refuses one not after a released one of its priority). A request that leaves before
        (a grammar that failed finishes in error) never arrives."""
        requests = self.scheduler.requests
        for req_id, (request, event) in list(self._grammars.items()):
            if requests.get(req_id) is not request or request.is_finished():
                del self._grammars[req_id]
                continue
            blocked = request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            if blocked and not grammar_ready(request):
                continue
            del self._grammars[req_id]
            if self.config.preemption != "priority":
                queue = list(self.scheduler.waiting)
                behind = queue[queue.index(request) + 1 :] if request in queue else [None]
                known = [r for r in behind if r is None or r.request_id not in self._grammars]
                if known:
                    who = known[0].request_id if known[0] is not None else "off the queue"
                    self.refuse("blocked waiting request", f"{req_id}'s grammar ready before {who}")
            self._queue(request, event)

    def _schedule(self, original: Method) -> Method:
        def schedule(*args: Any, **kw: Any) -> Any:
            def body() -> Any:
                step = self.next_step
                self.next_step += 1
                self.events.append(("begin", step))
                self._reordered = False
                output = original(*args, **kw)
                if self.config.admission_window and not self._reordered:
                    if not getattr(output, "preempted_req_ids", None):  # deferred prefills
                        self.refuse("cache-aware admission", "a step that did not reorder")
                if self.loads.landing:
                    self.refuse(
                        "KV connector: a landed load not scheduled at once",
                        ", ".join(self.loads.landing),
                    )
                self.events.append(("submit", step))
                self._safe(self._submitted, step, output)
                return output

            return self._outermost("schedule", body)

        return schedule

    def _reorder(self, original: Method) -> Method:
        """Cache-aware admission (0.34.0): the spec reorders its own queue by the rule
        (``spec/admission.py``) at the step's first admission; this notes that vLLM reordered
        in this step (it does not where it defers prefills: refused in ``schedule``). Called
        from anywhere but ``schedule()`` (a test driving it), vLLM's queue changes where the
        spec's does not: refused."""

        def reorder(*args: Any, **kw: Any) -> Any:
            if self.entry != "schedule":
                self.refuse("cache-aware admission", "the reorder called outside schedule()")
            self._reordered = True
            return original(*args, **kw)

        return reorder

    def _submitted(self, step: int, output: Any) -> None:
        requests = self.scheduler.requests
        extra, self._extra = self._extra, 0
        if output.total_num_scheduled_tokens + extra > self.config.token_budget:
            self.refuse(
                "KV connector: a load not of whole blocks",
                f"its tail computed to the spec overruns step {step}'s token budget",
            )
        samples = {r: not requests[r].is_prefill_chunk for r in output.num_scheduled_tokens}
        self.in_flight.append(InFlight(step, output, samples))
        for req_id, drafts in output.scheduled_spec_decode_tokens.items():
            request = requests.get(req_id)
            past = request.num_computed_tokens - request.num_tokens if request else -1
            if request is not None and self.config.async_scheduling:
                # AsyncScheduler has just counted this decode's own token and its drafts among
                # the placeholders: the drafts reach exactly past the others'
                past -= request.num_output_placeholders - 1 - len(drafts)
            if not self.config.spec_tokens or len(drafts) != past:
                self.refuse("speculative decoding", f"{len(drafts)} draft tokens for {req_id}")

    def _prefill_lookahead(self, original: Method) -> Method:
        """Multi-module MTP's prefill lookahead shortens a prefill chunk so that it ends at
        the prompt's end or at least ``num_prefill_lookahead`` before it: a chunk size like
        any to the spec, which takes the ``schedule`` decision's tokens as given. Shortened
        to nothing, it makes vLLM pass over a waiting request and admit one behind it, which
        the spec's admission order does not allow: refused. (Where the KV-cache manager
        registers the last computed tokens late, ``num_reprefillable_tokens``, the scheduler
        is refused at every entry point.)"""

        def reserve(
            request: Request, num_computed_tokens: int, num_new_tokens: int, *args: Any, **kw: Any
        ) -> Any:
            tokens = original(request, num_computed_tokens, num_new_tokens, *args, **kw)
            waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if (
                waiting and num_new_tokens > 0 and not tokens
            ):  # shortened to nothing by the lookahead
                self.refuse("prefill lookahead (MTP)", f"{request.request_id} passed over")
            return tokens

        return reserve
