"""External KV loads through vLLM's own scheduler under ``kvspec fuzz --loads``
(``loads_factory``, ``recompute_loads_factory``, ``fail_loads_factory``): the fuzzer reaches the
KV connector's loads that kvspec's pytest plugin judges in vLLM's tests.

vLLM's ``Scheduler`` is built with a KV connector (``KVTransferConfig``): vLLM's own
``ExampleConnector``, the one the attachment models (``features.MODELLED_CONNECTORS``) and
vLLM's connector tests script on a CPU. Its scheduler side is scripted here the same way, on the
instance: ``get_num_new_matched_tokens`` answers for the requests the fuzzer sent with their
prompt in the external store (``add_request(..., external=True)``), the fuzzer's ``choices``
drawing whether the load is asynchronous and how many whole blocks past the local hit it holds
(up to what the spec lets a load take, ``spec.actions.loadable``); the load plan
(``update_state_after_alloc``, ``build_connector_meta``) plans nothing, since no worker runs.
The loop plays the worker's side: an asynchronous load lands in the output of the step that
started it (``KVConnectorOutput.finished_recving``), a synchronous one before that step's
forward pass (nothing to report). Everything judged is vLLM's: the blocks it allocates for the
external tokens, when it registers them, how it runs the request once the load has landed
(``attach.py`` derives the events, ``AsyncLoads`` follows the waiting request).

**Load failures, by vLLM's policy** (``KVTransferConfig.kv_load_failure_policy``). The failure
factories draw, for each asynchronous load, whether it fails (``failed_recving``, as the
reference engine draws ``load-fails``), and hand it to vLLM's real failure handling
(``_handle_failed_recving``); ``docs/adapters.md`` says what each policy is to the spec:

* ``fail`` (vLLM's default, ``fail_loads_factory``): the request is finished in error inside
  ``update_from_output``, its blocks freed as the load's ``finished_recving`` is handled: to
  the spec, the failed load (its blocks freed at the commit) and an abort of the request. The
  attachment judges it where that is exact (``attach.Attachment._failed_loads``), so a load
  fails here only when it is of one block (vLLM frees the table as one batch, the spec one
  block at a time: the same free queue with one unregistered block);
* ``recompute`` (``recompute_loads_factory``): the request's computed tokens drop to 0 and it
  keeps its blocks, freed only when a later ``schedule()`` reaches it in the waiting queue
  (``_update_waiting_for_remote_kv``): the spec frees them at the commit, so the attachment
  refuses the first failure by name ("KV connector: load failures"), ending the run (exit 2).

``loads_factory``'s loads never fail, so it judges vLLM's loads whole. Depth 1 to
``MAX_DEPTH`` with the synchronous ``Scheduler`` (pipeline parallelism), stale output
delivered; async scheduling is not run beside a connector here.

**The workload keeps to what the attachment judges**, since a refusal ends the fuzz run: a load
is asynchronous only for a request alone in the engine, at depth 1 (vLLM appends a loaded
request to ``running`` when it is scheduled after landing, the spec at its admission: a request
admitted behind it, a preemption before it is scheduled, or a landed request the next
``schedule()`` does not reach, are refused by the attachment); and an abort of a request vLLM
keeps in ``WAITING_FOR_REMOTE_KVS`` is declined (``abort``). Synchronous loads are drawn at
every depth.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from functools import lru_cache
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvspec.reference.choices import Choices
from kvspec.spec import Config
from kvspec.spec.actions import loadable

from . import reuse as reuse_
from .attach import config_of
from .build import new_vllm_config, scheduler_on
from .loop import InFlight, VllmAdapter

POLICIES = ("recompute", "fail")
"""vLLM's ``kv_load_failure_policy`` values (``fail`` is its default)."""


@lru_cache(maxsize=1)
def _store() -> str:
    """The ``ExampleConnector``'s storage folder: it is never written (no worker runs)."""
    return tempfile.mkdtemp(prefix="kvspec-vllm-store-")


def transfer_config(policy: str) -> KVTransferConfig:
    """vLLM's ``ExampleConnector`` as producer and consumer, failing loads by ``policy``."""
    return KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": _store()},
        kv_load_failure_policy=policy,
    )


class LoadsAdapter(VllmAdapter):
    """``VllmAdapter`` over a scheduler with a scripted ``ExampleConnector`` (module docstring).
    ``policy``: vLLM's load-failure policy; ``failures``: whether asynchronous loads may fail."""

    supports_loads = True

    def __init__(
        self,
        config: Config,
        choices: Choices,
        policy: str = "fail",
        failures: bool = False,
        reuse: bool | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"vLLM's kv_load_failure_policy is one of {POLICIES}, not {policy!r}")
        self.policy = policy
        self.failures = failures
        super().__init__(config, choices, drop_stale=False, async_scheduling=False, reuse=reuse)
        self.external: set[str] = set()
        """Requests whose prompt the external store holds."""
        self.loading: set[str] = set()
        """Requests vLLM keeps waiting for an asynchronous load not reported yet."""
        self.started: dict[int, set[str]] = {}
        """A step -> the asynchronous loads its ``schedule()`` started."""
        self.sizes: dict[str, int] = {}
        """A request -> the blocks of its last drawn external hit."""
        connector = self.scheduler.connector
        connector.get_num_new_matched_tokens = self._matched
        connector.update_state_after_alloc = lambda request, blocks, num_external_tokens: None
        connector.build_connector_meta = lambda scheduler_output: KVConnectorMetadata()

    def build_scheduler(
        self, config: Config, async_scheduling: bool, threshold: int, reuse: bool
    ) -> Any:
        """``build.build_scheduler``'s scheduler with the connector of ``transfer_config``."""
        key = ("loads", self.policy, config.num_blocks, config.block_size, config.token_budget)
        key += (config.max_running, config.preemption, config.depth)
        built = lambda: new_vllm_config(  # noqa: E731
            config.num_blocks,
            config.block_size,
            config.token_budget,
            config.max_running,
            config.preemption,
            config.depth,
            async_scheduling,
            kv_transfer=transfer_config(self.policy),
        )
        vconfig = reuse_.configs.get(key, built) if reuse else built()
        scheduler = scheduler_on(vconfig, config, async_scheduling)
        claimed = config_of(scheduler)  # what the connector changes of the spec's model
        self.config = replace(
            self.config,
            delay_load_registration=claimed.delay_load_registration,
            defer_free=claimed.defer_free,
            defer_loads=claimed.defer_loads,
        )
        return scheduler

    def add_request(
        self,
        rid: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        priority: int,
        external: bool = False,
    ) -> None:
        if external:
            self.external.add(str(rid))
        super().add_request(rid, prompt, max_tokens, priority)

    def abort(self, rid: int) -> bool:
        """Abort a live request, but not one vLLM keeps waiting for an asynchronous load
        (False, as for a request that is not live): in flight, vLLM would keep its blocks until
        the load reports (a delayed free); landed, it would free a batch of several unhashed
        blocks, whose order at the free queue's head the spec does not follow (both refused by
        the attachment)."""
        request = self.scheduler.requests.get(str(rid))
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        return super().abort(rid)

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """The connector's answer at an admission: how many tokens past the local hit the store
        holds (whole blocks, drawn), and whether they load asynchronously (drawn)."""
        if request.request_id not in self.external:
            return 0, False
        bsz = self.config.block_size
        # Asynchronous only for a request alone in the engine, at depth 1 (module docstring).
        alone = self.config.depth == 1 and all(
            other is request for other in self.scheduler.requests.values()
        )
        asynchronous = alone and self.choices.pick(2, "vllm-load-async") == 1
        room = loadable(request.num_tokens, bsz, asynchronous) - num_computed_tokens // bsz
        if room <= 0:
            return 0, False
        blocks = self.choices.pick(room + 1, "vllm-loaded-blocks")
        self.sizes[request.request_id] = blocks
        return blocks * bsz, asynchronous and blocks > 0

    def step(self) -> bool:
        """``VllmAdapter.step``; the asynchronous loads a ``schedule()`` started are noted for
        its step's output."""
        queued = len(self.queue)
        busy = super().step()
        if len(self.queue) > queued:
            waiting = {
                req_id
                for req_id, request in self.scheduler.requests.items()
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            }
            self.started[self.queue[-1].step] = waiting - self.loading
            self.loading |= waiting
        return busy

    def runner_output(self, oldest: InFlight, req_ids: list[str], tokens: list[list[int]]) -> Any:
        """The runner's output, with the worker's report of the step's asynchronous loads (all
        landed; with ``failures``, each failed or not as drawn)."""
        runner = super().runner_output(oldest, req_ids, tokens)
        started = sorted(self.started.pop(oldest.step, set()) & self.loading)
        if started:
            failed = set()
            for req_id in started:
                # under ``fail`` only a load of one block fails (module docstring)
                may_fail = self.policy == "recompute" or self.sizes.get(req_id) == 1
                if self.failures and may_fail and self.choices.pick(2, "load-fails") == 1:
                    failed.add(req_id)
            self.loading -= set(started)
            runner.kv_connector_output = KVConnectorOutput(
                finished_recving=set(started), failed_recving=failed
            )
        return runner

    def failed_loads(self, runner: Any) -> tuple[int, ...]:
        """The failed loads of ``runner_output``'s report, as the spec's request ids."""
        transfers = runner.kv_connector_output
        failed = transfers.failed_recving if transfers is not None else ()
        return tuple(sorted(int(req_id) for req_id in failed or ()))


def _loads_adapter(config: Config, choices: Choices, policy: str, failures: bool) -> LoadsAdapter:
    from . import supported

    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return LoadsAdapter(config, choices, policy=policy, failures=failures)


def loads_factory(config: Config, choices: Choices) -> LoadsAdapter:
    """vLLM's synchronous ``Scheduler`` with a KV connector whose loads, synchronous and
    asynchronous, always land (``kvspec fuzz --target ...vllm_adapter.loads:loads_factory
    --loads``)."""
    return _loads_adapter(config, choices, "fail", failures=False)


def recompute_loads_factory(config: Config, choices: Choices) -> LoadsAdapter:
    """``loads_factory`` under ``kv_load_failure_policy="recompute"``, some asynchronous loads
    failing: the first failure ends the run, refused (module docstring)."""
    return _loads_adapter(config, choices, "recompute", failures=True)


def fail_loads_factory(config: Config, choices: Choices) -> LoadsAdapter:
    """``loads_factory`` under ``kv_load_failure_policy="fail"`` (vLLM's default), some
    asynchronous loads of one block failing: each judged as the spec's failed load and an
    abort of its request (module docstring)."""
    return _loads_adapter(config, choices, "fail", failures=True)
