"""Outputs and finishes: the part of ``Attachment`` (``attach.py``) that wraps
``Scheduler.update_from_output`` (the ``execute`` and ``commit`` of the oldest step in flight,
the tokens read by vLLM's rules, failed asynchronous loads under the ``fail`` policy),
``finish_requests`` (aborts) and ``_free_request`` (a request's ``finish``).

A commit lists the tokens vLLM appends: live requests' and, in vLLM's default mode, stale output
delivered to a preempted request; a stop token is the configuration's (``_stops``); an output
with no token where one was due is withheld (``_withhold_commit``). The attachment's state
lives in ``Attachment``; this class only groups its methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.request import Request, RequestStatus

from .methods import Method
from .versions import output_index

REASONS = {
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_REPETITION: "stop",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class OutputCalls:
    """``Attachment``'s wrappers of outputs, aborts and finishes."""

    def _update_from_output(self, original: Method) -> Method:
        def update_from_output(
            scheduler_output: Any, model_runner_output: Any, *args: Any, **kw: Any
        ) -> Any:
            def body() -> Any:
                at = self._safe(self._commit, scheduler_output, model_runner_output)
                self._finishing = {}
                try:
                    result = original(scheduler_output, model_runner_output, *args, **kw)
                finally:
                    failing, self._failing = self._failing, {}
                if at is not None:
                    self._safe(self._stops, at)
                    self._safe(self._failed_finished, failing)
                self._safe(self._withhold_commit)
                return result

            return self._outermost("update_from_output", body)

        return update_from_output

    def _commit(self, output: Any, runner: Any) -> int | None:
        """Append ``execute`` and ``commit`` for the oldest step; return the commit's index."""
        found = next((i for i, f in enumerate(self.in_flight) if f.output is output), None)
        if found is None:
            self.refuse("an output schedule() did not make", "update_from_output")
            return None
        while found and not self.in_flight[0].output.num_scheduled_tokens:
            # An empty step whose output the caller never processed (a test's last schedule()
            # of a round): it holds no request, so nothing is out of order, and its commit
            # changes nothing the spec models; it commits before the output processed now.
            skipped = self.in_flight.pop(0)
            self.events += [("execute", skipped.step, ()), ("commit", skipped.step, ())]
            found -= 1
        if found != 0:
            self.refuse("outputs processed out of order", f"step {self.in_flight[found].step}")
        oldest = self.in_flight.pop(found)
        sampled: list[tuple[int, int]] = []
        requests = self.scheduler.requests
        tokens_of = runner.sampled_token_ids or []
        index = output_index(runner)
        transfers = runner.kv_connector_output
        if transfers is not None:
            failed = self._failed_loads(output, transfers)
            if transfers.finished_sending:
                self.refuse("KV connector: finished sends", "blocks held while sent")
            for req_id in transfers.finished_recving or ():
                if req_id not in self.loads.waiting:
                    self.refuse("KV connector: a load landing for no loading request", req_id)
        if runner.pooler_output:
            self.refuse("pooling", "pooler output")
        unsampled: list[str] = []
        for req_id in output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.is_finished():
                continue  # vLLM skips requests finished or aborted since
            got = (
                tokens_of[index[req_id]]
                if req_id in index and index[req_id] < len(tokens_of)
                else []
            )
            got = list(got) if got is not None else []
            # Preempted while this step held it: vLLM drops the output in drop mode, else
            # delivers it to the waiting request (the spec's two stale-output modes).
            if request.num_stale_output_tokens > 0 and request.drop_stale_output:
                continue
            wants = oldest.samples.get(req_id, False)
            drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            if len(got) > 1 + drafts:
                self.refuse("several tokens in a step", f"{len(got)} for {req_id}, {drafts} drafts")
            elif got and not wants:
                self.refuse("a token sampled mid-prefill", f"{req_id} (a real runner samples none)")
            elif wants and not got:
                unsampled.append(req_id)
            rid = self.ids[req_id]
            sampled += [(rid, int(token)) for token in got[: 1 + drafts]]
            if len(got) > 1:  # accepted drafts: how many vLLM appends is read after it ran
                self._lengths[rid] = (request, request.num_tokens)
        self.events.append(("execute", oldest.step, failed if transfers is not None else ()))
        if unsampled:  # no commit the spec can take: withheld (_withhold_commit)
            self._unsampled = f"{', '.join(unsampled)} reached the end of its tokens"
            self._unsampled_at = len(self.events)
            return None
        self.events.append(("commit", oldest.step, tuple(sampled)))
        return len(self.events) - 1

    def _failed_loads(self, output: Any, transfers: Any) -> tuple[int, ...]:
        """The requests whose asynchronous load the output reports failed, judged where vLLM's
        ``fail`` policy is the spec's failed load followed by an abort of its request
        (``docs/adapters.md``, "Load failures"): the step only loads (no other request's finish
        comes before the failed one's, as vLLM orders them), the failed request holds at most
        one unregistered block (vLLM frees its table as one batch, the spec one block at a time:
        the same queue with one unhashed block), nothing defers the free, and the worker reports
        the load finished too (else vLLM keeps the blocks). Anything else is refused by name."""
        failed_ids = set(transfers.failed_recving or ())
        if transfers.invalid_block_ids:
            self.refuse("KV connector: load failures", "invalid_block_ids (block-level)")
        if not failed_ids:
            return ()
        if self.scheduler.recompute_kv_load_failures:
            self.refuse("KV connector: load failures", "kv_load_failure_policy recompute")
            return ()
        if output.num_scheduled_tokens or self.config.defer_free:
            self.refuse("KV connector: load failures", "a failed load beside computed requests")
            return ()
        if not failed_ids <= set(transfers.finished_recving or ()):
            self.refuse("KV connector: load failures", "failed_recving not in finished_recving")
            return ()
        manager, pool = self.scheduler.kv_cache_manager, self.pool
        for req_id in sorted(failed_ids):
            if req_id not in self.loads.waiting or req_id not in self.ids:
                self.refuse("KV connector: a load landing for no loading request", req_id)
                return ()
            (table,) = manager.get_block_ids(req_id)
            if sum(1 for b in table if pool.blocks[b].block_hash is None) > 1:
                self.refuse(
                    "KV connector: load failures",
                    f"{req_id}'s failed load holds several unregistered blocks",
                )
                return ()
            self._failing[req_id] = self.ids[req_id]
        return tuple(sorted(self._failing.values()))

    def _failed_finished(self, failing: dict[str, int]) -> None:
        """After vLLM's ``fail`` policy ended the failed loads' requests (an error finish, the
        blocks freed when the load's ``finished_recving`` is handled, after the step's other
        finishes): the spec's ``load_failed`` closes its commit's effects, then the request is
        aborted (``_failed_loads``)."""
        for req_id, rid in failing.items():
            request = self.scheduler.requests.get(req_id)
            if request is not None:
                self.refuse("KV connector: load failures", f"{req_id} keeps its blocks")
                return
            self.events += [("load_failed", rid), ("abort", rid), ("finish", rid, "abort")]

    def _withhold_commit(self) -> None:
        """A runner output with no token for a request at the end of its tokens (no real runner
        makes one; vLLM's tests do, to see the scheduler survive it): the spec's ``commit``
        needs a token, so the step stays executed and uncommitted to the spec. What vLLM did
        before it was judged; the output itself is judged as far as blocks go: it must change
        none (no effect recorded while vLLM processed it), and vLLM driven past it at all ends
        judging ("no token sampled", at the next entry point)."""
        if self._unsampled is not None and len(self.events) != self._unsampled_at:
            self.refuse("no token sampled", f"{self._unsampled}, and the output changed blocks")

    def _stops(self, at: int) -> None:
        """A token at which vLLM stopped its request is the spec's stop token."""
        kind, step, sampled = self.events[at]
        fixed: list[tuple[int, int]] = []
        kept = {  # with accepted drafts vLLM appends a request's tokens up to its stop
            rid: request.num_tokens - before for rid, (request, before) in self._lengths.items()
        }
        self._lengths = {}
        for rid, n in kept.items():
            if n < 1:
                self.refuse("sampled tokens not appended", f"r{rid}: vLLM appended none")
        for rid, token in sampled:  # type: ignore[attr-defined]
            done, limit = sum(1 for r, _ in fixed if r == rid), kept.get(rid)
            if limit is not None and 0 < limit <= done:
                continue  # trimmed by vLLM after its stop
            stopped = self._finishing.get(rid) == "stop" and (limit is None or done + 1 == limit)
            if stopped and token != self.config.stop_token:
                if self.config.stop_token is None:
                    self.refuse("a stop the spec cannot express", f"r{rid} stops at {token}")
                else:
                    token = self.config.stop_token
            elif not stopped and token == self.config.stop_token:
                self.refuse("a stop token that does not stop", f"r{rid} samples {token}")
            fixed.append((rid, token))
        self.events[at] = (kind, step, tuple(fixed))

    def _finish_requests(self, original: Method) -> Method:
        def finish_requests(request_ids: Any, finished_status: Any, *args: Any, **kw: Any) -> Any:
            if self.depth:  # inside update_from_output: vLLM's own error path
                ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
                known = set(self._grammars) | set(self._failing)
                if request_ids is None or any(r not in known for r in ids):
                    self.refuse("request errors", f"finish_requests({finished_status}) by vLLM")
                # a failed grammar's request, kept from the spec: it leaves unseen
                return original(request_ids, finished_status, *args, **kw)

            def body() -> Any:
                self._safe(self._mark_aborts, request_ids)
                try:
                    return original(request_ids, finished_status, *args, **kw)
                finally:
                    self._aborting = set()

            return self._outermost("finish_requests", body)

        return finish_requests

    def _mark_aborts(self, request_ids: Any) -> None:
        requests = self.scheduler.requests
        if request_ids is None:
            ids: Iterable[str] = list(requests)
        elif isinstance(request_ids, str):
            ids = (request_ids,)
        else:
            ids = list(request_ids)
        self._aborting = {
            r for r in ids if r in requests and not requests[r].is_finished() and r in self.ids
        }

    def _free_request(self, original: Method) -> Method:
        def free_request(request: Request, *args: Any, **kw: Any) -> Any:
            if self._grammars.pop(request.request_id, None) is not None:
                return original(request, *args, **kw)  # it never arrived to the spec
            if request.request_id in self._failing:  # its events: _failed_finished
                self.loads.forget(request.request_id)
                self._admitted.pop(request.request_id, None)
                self._appended.pop(request.request_id, None)
                return original(request, *args, **kw)
            if self.config.sliding_window is not None and self.scheduler.connector is not None:
                # vLLM's _connector_finished frees the blocks before the window first: the
                # spec's WindowFinish (Config.trim_at_finish, features.trims_at_finish)
                if not self.config.trim_at_finish:
                    self.refuse(
                        "sliding window", f"{request.request_id} finishes beside a KV connector"
                    )
            rid = self.ids.get(request.request_id)
            self.loads.forget(request.request_id)
            self._admitted.pop(request.request_id, None)
            self._appended.pop(request.request_id, None)
            aborted = request.request_id in self._aborting
            if aborted:
                self._aborting.discard(request.request_id)
                self.events.append(("abort", rid))
            result = original(request, *args, **kw)
            if request.request_id in self.scheduler.requests:
                self.refuse("delayed block free", f"{request.request_id} keeps its blocks")
            reason = "abort" if aborted else REASONS.get(request.status)
            if reason is None:
                self.refuse(f"finish {request.status}", "a finish the spec does not have")
                reason = str(request.status)
            if rid is not None:
                self._finishing[rid] = reason
            self.events.append(("finish", rid, reason))
            return result

        return free_request
