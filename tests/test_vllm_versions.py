"""vLLM's names per release (``conformance/adapters/vllm_adapter/versions.py``) and the CPU
platform (``cpu_platform.py``), on the installed vLLM: run where vLLM imports
(``tests/test_adapter_vllm.py`` runs this file in every supported release's environment).

A name kvspec reads that is missing is a refusal naming it, never an internal error; a release
outside the supported set is tried with one message; 0.34.0's new block-lifecycle features
(cache-aware admission, ``max_num_inflight_kv_loads``, ``evict_first``) are each refused by name
where they show; a bounded or skipped prefix-cache read is judged, its admission carrying the
bound."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvspec.conformance.adapters.vllm_adapter import (  # noqa: E402
    attach,
    attach_pool,
    build,
    cpu_platform,
    versions,
)
from kvspec.conformance.adapters.vllm_adapter.attach import EVICT_FIRST  # noqa: E402
from kvspec.spec import Config  # noqa: E402

ON_034 = pytest.mark.skipif(vllm.__version__ != "0.34.0", reason="a feature new in vLLM 0.34.0")
CELL = Config(num_blocks=16, block_size=2, token_budget=16, max_running=4, policy="eager-unsafe")


def test_the_installed_release_is_supported_and_named() -> None:
    release = versions.installed()
    assert release.version == vllm.__version__.split("+")[0] in versions.SUPPORTED
    assert versions.unsupported_message(vllm.__version__) is None


def test_the_plugin_names_the_same_releases() -> None:
    from kvspec import pytest_plugin

    assert pytest_plugin.SUPPORTED_VLLM == versions.SUPPORTED == pytest_plugin.supported_versions()


def test_an_error_after_a_refusal_is_kept_apart_not_counted() -> None:
    """Once a feature is refused, judging has stopped and kvspec's bookkeeping no longer follows
    vLLM: an error there is kept apart; before any refusal it is kvspec's internal error."""
    from kvspec.conformance.adapters.vllm_adapter.attach import Refusal, internal_error

    refused: list[tuple[str, str]] = []
    owner = types.SimpleNamespace(
        refusal=Refusal("streaming input", "a resumable request", "run"),
        error=None,
        error_after_refusal=None,
        refuse=lambda feature, detail="", at="run": refused.append((feature, detail)),
    )
    internal_error(owner, "KeyError: 's' (in _commit)")
    assert owner.error is None and owner.error_after_refusal == "KeyError: 's' (in _commit)"
    assert refused == []
    owner.refusal = None
    internal_error(owner, "KeyError: 't'")
    assert owner.error == "KeyError: 't'" and refused == [
        ("kvspec internal error", "KeyError: 't'")
    ]


def test_another_release_is_tried_with_one_message_naming_the_supported_ones() -> None:
    message = versions.unsupported_message("0.35.1")
    assert message is not None and "0.33.0, 0.34.0" in message and "0.34.0's names" in message
    assert versions.release_for("0.35.1").version == "0.34.0"
    assert versions.release_for("0.32.0").version == "0.33.0"  # older than all: the oldest
    assert versions.release_for("0.34.1rc1").version == "0.34.0"
    assert versions.unsupported_message("0.34.0+cpu") is None  # a build of a supported release


def test_a_missing_name_is_a_refusal_naming_it_not_an_internal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted: kvspec's table names the other release's prefix-cache read (as a release that
    renamed it again would find), read at each admission: the second request's admission is
    refused by name, the run goes on unjudged, no internal error."""
    release = versions.installed()
    other = [r for v, r in versions.RELEASES.items() if v != release.version][0]
    monkeypatch.setattr(
        versions, "installed", lambda: dataclasses.replace(release, prefix_read=other.prefix_read)
    )
    scheduler = build.build_scheduler(CELL, async_scheduling=False, reuse=False)
    attachment = attach(scheduler)
    assert attachment.refusal is None
    _drive(scheduler, [_request("0", [1, 2, 3], SamplingParams(max_tokens=1))])
    assert attachment.error is None
    assert attachment.refusal is not None and attachment.refusal.feature == versions.FEATURE
    detail = attachment.refusal.detail
    assert f"vLLM {release.version}: `Request.{other.prefix_read}` not found" in detail, detail
    assert "kvspec supports 0.33.0, 0.34.0" in detail


def test_a_missing_name_at_construction_is_refused_there() -> None:
    scheduler = build.build_scheduler(CELL, async_scheduling=False, reuse=False)
    del scheduler.num_spec_tokens
    attachment = attach(scheduler)
    assert attachment.error is None and attachment.refusal is not None
    assert attachment.refusal.at == "construction"
    assert "`Scheduler.num_spec_tokens` not found" in attachment.refusal.detail


def test_the_cpu_platform_builds_a_config_without_triton_cpu() -> None:
    from vllm.platforms import current_platform

    waived = isinstance(current_platform, cpu_platform.SchedulerCpuPlatform)
    assert waived == versions.installed().cpu_needs_triton
    config = build.new_vllm_config(8, 2, 8, 2, "fcfs", 1, False)
    assert config.cache_config.block_size == 2


def _drive(scheduler: Any, requests: list[Request]) -> None:
    """Add the requests, then schedule and answer every step (one token each) until done."""
    for request in requests:
        scheduler.add_request(request)
    for _ in range(64):
        if not scheduler.has_requests():
            return
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        scheduler.update_from_output(output, versions.runner_output(ids, [[1] for _ in ids]))


def _request(rid: str, prompt: list[int], params: SamplingParams) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        arrival_time=float(rid),
        block_hasher=build.block_hasher(CELL.block_size),
    )


@pytest.mark.parametrize(
    ("params", "bound"),
    [
        (dict(prompt_logprobs=1, prompt_logprob_start=2, skip_reading_prefix_cache=False), 2),
        (dict(prompt_logprobs=1), 0),
        (dict(), None),
    ],
    ids=["bounded", "skipped", "unbounded"],
)
def test_a_bounded_or_skipped_prefix_cache_read_is_carried_by_its_admission(
    params: dict[str, Any], bound: int | None
) -> None:
    """r0 caches three blocks of its prompt; r1 repeats it with its read bounded (0.34.0:
    ``prefix_cache_hit_limit`` 2, one block), skipped (limit 0; 0.33.0's
    ``skip_reading_prefix_cache``), or unbounded: judged, r1's admission carrying the bound in
    tokens (``docs/model.md``, "Bounded hits"), the unbounded one none."""
    if params.get("prompt_logprob_start") and vllm.__version__ != "0.34.0":
        pytest.skip("bounded reads are new in vLLM 0.34.0")
    scheduler = build.build_scheduler(CELL, async_scheduling=False, reuse=False)
    attachment = attach(scheduler)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    _drive(scheduler, [_request("0", prompt, SamplingParams(max_tokens=1))])
    assert attachment.refusal is None
    _drive(scheduler, [_request("1", prompt, SamplingParams(max_tokens=1, **params))])
    assert attachment.refusal is None and attachment.error is None, attachment.refusal
    (admission,) = [e for e in attachment.events if e[:2] == ("schedule", 1)]
    assert admission[4:] == (() if bound is None else (bound,)), admission
    (hit,) = [e for e in attachment.events if e[:2] == ("hit", 1)]
    assert len(hit[2]) == (3 if bound is None else bound // CELL.block_size), hit


@ON_034
@pytest.mark.parametrize(
    ("option", "value", "feature"),
    [("max_num_inflight_kv_loads", 2, "in-flight KV load limit")],
)
def test_new_admission_options_are_refused_at_construction(
    option: str, value: int, feature: str
) -> None:
    vconfig = build.new_vllm_config(16, 2, 16, 4, "fcfs", 1, False)
    setattr(vconfig.scheduler_config, option, value)
    scheduler = build.scheduler_on(vconfig, CELL, async_scheduling=False)
    attachment = attach(scheduler)
    assert attachment.refusal is not None and attachment.refusal.at == "construction"
    assert feature in attachment.refusal.features, attachment.refusal


@ON_034
def test_cache_aware_admission_is_modelled_at_construction() -> None:
    """``cache_aware_admission_window`` on a plain fcfs scheduler with caching: no refusal, the
    spec's configuration carries the window and the threshold (``spec/admission.py``; the
    judging itself: ``tests/test_vllm_plugin_admission.py``)."""
    vconfig = build.new_vllm_config(16, 2, 16, 4, "fcfs", 1, False)
    vconfig.scheduler_config.cache_aware_admission_window = 4
    vconfig.scheduler_config.cache_aware_admission_threshold = 0.25
    scheduler = build.scheduler_on(vconfig, CELL, async_scheduling=False)
    attachment = attach(scheduler)
    assert attachment.refusal is None, attachment.refusal
    assert (attachment.config.admission_window, attachment.config.admission_threshold) == (4, 0.25)


@ON_034
def test_freed_cached_blocks_evicted_first_are_refused_and_freed_as_vllm_frees_them() -> None:
    """``free_blocks(blocks, evict_first=True)`` puts freed cached blocks at the head of the
    free queue: refused by name, the call going through to vLLM as asked."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=2)
    attachment = attach_pool(pool)
    blocks = pool.get_new_blocks(2)
    for i, block in enumerate(blocks):
        pool._insert_block_hash(make_block_hash_with_group_id(bytes([i]), 0), block, 2)
    pool.free_blocks(blocks, evict_first=True)
    assert attachment.error is None
    assert attachment.refusal is not None
    assert attachment.refusal.feature == EVICT_FIRST[0]
    head = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()][:2]
    assert set(head) == {b.block_id for b in blocks}, head  # vLLM's effect, as without kvspec
