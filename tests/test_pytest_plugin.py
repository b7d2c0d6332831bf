"""kvspec's pytest plugin on vLLM-style tests (``tests/vllm_cases``, vLLM's objects only), run in
``.venv-vllm`` with and without the plugin: the seed's scenario fails with NoUnwrittenPublish,
a planted pool bug (touch after allocate) with TouchBeforeAllocate, the seed's scenario under
async scheduling (``AsyncScheduler``, two steps in flight) with NoUnwrittenPublish, the correct
tests (synchronous and async, and a scheduler without prefix caching) pass, a planted bug in
the free order without prefix caching (one block at a time instead of vLLM's batch) fails with
a Disagreement on the free queue, speculative decoding (drafts accepted and rejected, with and
without preemption) holds and a planted publish over a rejected draft fails with a
Disagreement, speculative decoding under async scheduling (a batch queue of two steps, decodes
scheduled as if every draft were accepted, with and without preemption in flight) holds and a
planted registration of rejected drafts fails with a Disagreement (a test's spy that calls
through kvspec's wrapper is judged, one that does not is refused), a KV connector's synchronous
and asynchronous loads hold and blocks cached before their asynchronous load has landed fail
with a Disagreement, an EC connector and an aux output connector hold (text-only requests
sharing prefixes) and a planted free order under the aux output connector (a table freed head
first) fails with a Disagreement while a delayed free is refused and a capped prefix-cache hit holds,
``defer_block_free``'s deferred frees hold and a free at once or a drain before the fence fail
with a Disagreement, a feature the spec does not model is refused (listed, never failed; every
one seen at construction, not only the first), the features judged where the spec covers them
(``case_lifted.py``: arrivals out of order, resets preempting, skipped reads, LoRA, prefill
lookahead, structured output, images) hold, with their planted bugs failing and their refused
variants refused, one sliding-window group under async scheduling holds while blocks before
the window freed on the optimistic count or a hit short of the window fail with a Disagreement
(``case_window.py``), and without the plugin every case passes. Skipped without ``.venv-vllm``
(``make thirdparty``)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
CASES = ROOT / "tests" / "vllm_cases"

needs_vllm = pytest.mark.skipif(
    not (VENV / ".stamp").exists(), reason="no .venv-vllm: run `make thirdparty` to build it"
)


def _pytest(
    tmp_path: Path, *argv: str, venv: Path = VENV, rootdir: Path | None = None, timeout: int = 600
) -> tuple[subprocess.CompletedProcess[str], dict]:
    """pytest in ``venv`` on ``argv`` (vLLM on the CPU, a one-layer OPT for its model), run in
    ``tmp_path`` with the plugin's report there unless ``no:kvspec.pytest_plugin`` is asked: the
    finished process and the report's tests by name. ``rootdir`` (default ``tmp_path``) names
    the tests: under the case folder a node id carries its file's name."""
    report = tmp_path / "report.json"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    redirect = tmp_path / "redirect.json"
    model = tmp_path / "opt"
    model.mkdir(exist_ok=True)
    config = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64}
    config |= {"ffn_dim": 128, "num_attention_heads": 2, "num_hidden_layers": 1}
    config |= {"vocab_size": 50272, "max_position_embeddings": 2048}
    (model / "config.json").write_text(json.dumps(config))
    redirect.write_text(json.dumps({"facebook/opt-125m": str(model)}))
    env["VLLM_MODEL_REDIRECT_PATH"] = str(redirect)
    if "no:kvspec.pytest_plugin" not in argv:
        argv += ("--kvspec", f"--kvspec-report={report}")
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv]
        + ["--rootdir", str(rootdir or tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=timeout,
    )
    tests = json.loads(report.read_text())["tests"] if report.exists() else {}
    return done, {name.split("::")[-1]: entry for name, entry in tests.items()}


LIFTED = {  # case_lifted.py: test -> (outcome, its finding's start or its one feature)
    "test_priority_arrivals_out_of_order_hold": ("judged", ""),
    "test_priority_order_ignoring_arrival_time": (
        "violation",
        "Illegal: schedule r1 in step 0: vllm admits the head of the waiting queue first",
    ),
    "test_equal_arrival_times_are_refused": ("run", "arrival times out of order"),
    "test_reset_preempting_running_requests_holds[fcfs]": ("judged", ""),
    "test_reset_preempting_running_requests_holds[priority]": ("judged", ""),
    "test_reset_preempting_from_the_head": (
        "violation",
        "Illegal: preempt r0 in step 2: fcfs preempts the unscheduled tail of running",
    ),
    "test_skipped_read_with_nothing_to_hit_holds": ("judged", ""),
    "test_skipped_read_that_would_hit_holds": ("judged", ""),  # its bound 0 (Bounded hits)
    "test_lora_within_max_loras_holds": ("judged", ""),
    "test_a_request_passed_over_for_max_loras_is_refused": ("run", "LoRA"),
    "test_one_prompt_under_two_adapters_is_refused": (
        "run",
        "block hashes not a function of the tokens",
    ),
    "test_prefill_lookahead_chunks_hold": ("judged", ""),
    "test_prefill_lookahead_passing_over_a_request_is_refused": ("run", "prefill lookahead (MTP)"),
    "test_structured_output_with_its_grammar_ready_holds": ("judged", ""),
    "test_structured_output_passed_over_while_its_grammar_compiles_holds": ("judged", ""),
    "test_structured_output_whose_grammar_fails_holds": ("judged", ""),
    "test_structured_output_ready_ahead_of_a_later_arrival_is_refused": (
        "run",
        "blocked waiting request",
    ),
    "test_a_request_passed_over_earlier_and_queued_behind_holds": ("judged", ""),
    "test_a_preemption_by_the_test_holds": ("judged", ""),
    "test_a_preemption_by_the_test_under_async_scheduling_holds": ("judged", ""),
    "test_a_preemption_by_the_test_of_another_than_the_tail_is_refused": (
        "run",
        "preemption outside schedule()",
    ),
    "test_images_hold": ("judged", ""),
    "test_a_request_passed_over_for_its_image_is_refused": ("run", "a waiting request passed over"),
    "test_one_prompt_with_two_images_is_refused": (
        "run",
        "block hashes not a function of the tokens",
    ),
}


@needs_vllm
def test_the_plugin_judges_vllm_style_tests(tmp_path: Path) -> None:
    done, tests = _pytest(
        tmp_path,
        str(CASES / "case_seed.py"),
        str(CASES / "case_pool.py"),
        str(CASES / "case_refused.py"),
        str(CASES / "case_async.py"),
        str(CASES / "case_no_caching.py"),
        str(CASES / "case_spec_decode.py"),
        str(CASES / "case_connector.py"),
        str(CASES / "case_ec_aux.py"),
        str(CASES / "case_defer.py"),
        str(CASES / "case_async_spec_decode.py"),
        str(CASES / "case_lifted.py"),
        str(CASES / "case_window.py"),
        "-p",
        "kvspec.pytest_plugin",
    )
    out = done.stdout
    assert done.returncode == 1, out[-3000:] + done.stderr[-2000:]
    assert "14 failed" in out and "45 passed" in out, out[-3000:]
    seed = tests["test_priority_preempts_a_request_scheduled_in_the_same_step"]
    assert seed["outcome"] == "violation" and seed["finding"].startswith(
        "kvspec: NoUnwrittenPublish: block 5 is published"
    ), seed
    planted = tests["test_touch_after_allocate"]
    assert planted["outcome"] == "violation", planted
    assert planted["finding"].startswith("kvspec: TouchBeforeAllocate: block 2"), planted
    assert tests["test_fcfs_shared_prefixes_hold"]["outcome"] == "judged"
    assert tests["test_fcfs_shared_prefixes_hold"]["events"] > 50
    async_seed = tests["test_async_chunked_prefill_preempted_in_flight"]
    assert async_seed["outcome"] == "violation", async_seed
    assert async_seed["finding"].startswith(
        "kvspec: NoUnwrittenPublish: block 8 is published for a 112-token prefix"
    ), async_seed
    reused = tests["test_a_request_id_reused_after_its_request_finished_holds"]
    assert reused["outcome"] == "judged", reused  # a new request under a finished one's id
    async_holds = tests["test_async_shared_prefixes_hold"]
    assert async_holds["outcome"] == "judged" and async_holds["events"] > 50, async_holds
    assert tests["test_a_shared_prefix_is_hit_after_its_request_leaves"]["outcome"] == "pool"
    sub = tests["test_a_scheduler_subclass_is_refused"]
    assert sub["outcome"] == "construction", sub
    assert sub["features"] == ["Scheduler subclass CustomScheduler"], sub
    both = tests["test_every_feature_seen_at_construction_is_listed"]
    assert both["outcome"] == "construction", both
    assert both["features"] == [
        "async scheduling without AsyncScheduler",
        "Scheduler subclass CustomScheduler",
    ], both
    off = tests["test_caching_off_shared_prefixes_hold"]
    assert off["outcome"] == "judged" and off["events"] > 100, off  # prefix caching off
    order = tests["test_caching_off_freed_one_block_at_a_time"]
    assert order["outcome"] == "violation", order
    assert order["finding"].startswith("kvspec: Disagreement: free queue (1, 2, 3, 4, 9)"), order
    for name in ("test_synchronous_loads_hold", "test_asynchronous_loads_hold"):
        loads = tests[name]
        assert loads["outcome"] == "judged" and loads["events"] > 80, loads  # a KV connector
    early = tests["test_a_load_cached_before_it_lands"]
    assert early["outcome"] == "violation", early
    assert early["finding"].startswith(
        "kvspec: Disagreement: engine emitted ('publish', 0, 0, 1), but the spec computes no"
    ), early
    edited = tests["test_a_test_that_edits_vllm_state_is_refused"]
    assert edited["outcome"] == "run" and edited["features"] == ["state edited between calls"]
    assert tests["test_nothing_built"]["outcome"] == "none"
    for name in ("test_spec_decode_shared_prefixes_hold", "test_spec_decode_preempted_holds"):
        drafts = tests[name]  # draft tokens scheduled, accepted and rejected, judged
        assert drafts["outcome"] == "judged" and drafts["events"] > 100, drafts
    cached = tests["test_spec_decode_cached_past_the_computed_tokens"]
    assert cached["outcome"] == "violation", cached  # a block over a rejected draft published
    assert cached["finding"].startswith(
        "kvspec: Disagreement: engine emitted ('publish', 0, 2, 6)"
    ), cached
    for name in ("test_ec_connector_text_only_holds", "test_aux_output_connector_holds"):
        other = tests[name]  # an EC connector, an aux output connector: text-only, judged
        assert other["outcome"] == "judged" and other["events"] > 80, other
    delayed = tests["test_ec_connector_delaying_a_free_is_refused"]
    assert delayed["outcome"] == "run" and delayed["features"] == ["delayed block free"], delayed
    capped = tests["test_aux_output_connector_capping_a_hit_holds"]  # the bound carried
    assert capped["outcome"] == "judged" and capped["events"] > 40, capped
    head = tests["test_aux_output_connector_blocks_freed_head_first"]
    assert head["outcome"] == "violation", head  # a table freed head first, under aux output
    assert head["finding"].startswith(
        "kvspec: Disagreement: engine emitted ('free', 1), but the spec expects ('free', 5)"
    ), head
    held = tests["test_deferred_frees_hold"]  # defer_block_free, set after construction
    assert held["outcome"] == "judged" and held["events"] > 150, held
    for name, event in (
        ("test_a_free_at_once_is_caught", "('free', 5), but the spec expects ('finish', 1"),
        ("test_a_drain_before_the_fence_is_caught", "('free', 3), but the spec computes no"),
    ):
        planted = tests[name]
        assert planted["outcome"] == "violation", planted
        assert planted["finding"].startswith(f"kvspec: Disagreement: engine emitted {event}")
    for name in (
        "test_async_spec_decode_shared_prefixes_hold",
        "test_async_spec_decode_preempted_in_flight_holds",
        "test_async_spec_decode_counting_preemptions_holds",  # a test's spy, calling through
        # a spy failing allocations by itself: the test's answer in vLLM's place (methods.py)
        "test_async_spec_decode_failing_an_allocation_by_itself",
    ):
        drafts = tests[name]  # drafts under async scheduling, moved back over rejections
        assert drafts["outcome"] == "judged" and drafts["events"] > 100, drafts
    forgotten = tests["test_async_spec_decode_registers_rejected_drafts"]
    assert forgotten["outcome"] == "violation", forgotten  # rejected drafts registered
    assert forgotten["finding"].startswith(
        "kvspec: Disagreement: engine emitted ('publish', 0, 1, 2)"
    ), forgotten
    window = tests["test_sliding_window_holds"]  # one sliding-window group, async, judged
    assert window["outcome"] == "judged" and window["events"] > 200, window
    for name, event in (
        ("test_a_free_on_the_optimistic_count_is_caught", "('free', 4), but the spec expects"),
        ("test_a_hit_short_of_the_window_is_caught", "('hit', 1, (0, 0, 0, 0, 5)), but the spec"),
    ):
        planted = tests[name]
        assert planted["outcome"] == "violation", planted
        assert planted["finding"].startswith(f"kvspec: Disagreement: engine emitted {event}")
    for name, (outcome, what) in LIFTED.items():
        entry = tests[name]
        assert entry["outcome"] == outcome, entry
        if outcome == "violation":
            assert entry["finding"].startswith(f"kvspec: {what}"), entry
        elif outcome == "run":
            assert entry["features"] == [what], entry
    summary = out[out.index("= kvspec =") :]
    assert "14  violations" in summary and "31  judged and holding" in summary, summary
    assert "Scheduler subclass" in summary and "state edited between calls" in summary


@needs_vllm
def test_without_the_plugin_every_case_passes(tmp_path: Path) -> None:
    names = ("case_seed.py", "case_pool.py", "case_refused.py", "case_async.py")
    names += ("case_no_caching.py", "case_spec_decode.py", "case_connector.py", "case_ec_aux.py")
    names += ("case_defer.py", "case_async_spec_decode.py", "case_lifted.py", "case_window.py")
    cases = [str(CASES / f) for f in names]
    done, tests = _pytest(tmp_path, *cases, "-p", "no:kvspec.pytest_plugin")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "59 passed" in done.stdout and "= kvspec =" not in done.stdout
    assert tests == {}


def test_installing_kvspec_registers_the_plugin() -> None:
    (entry,) = [
        e for e in importlib.metadata.entry_points(group="pytest11") if e.value.startswith("kvspec")
    ]
    assert entry.name == entry.value == "kvspec.pytest_plugin"
    assert entry.load().judge_for.__doc__


LOADS = {  # case_loads.py: test -> (outcome, its finding's start or its one feature)
    "test_preemption_beside_landed_loads_holds": ("judged", ""),
    "test_preempting_the_head_beside_loads_is_caught": (
        "violation",
        "Illegal: preempt r0 in step 3: fcfs preempts the unscheduled tail of running",
    ),
    "test_preemption_beside_a_load_ranked_otherwise_is_refused": (
        "run",
        "KV connector: preemption beside an asynchronous load",
    ),
    "test_spec_decode_beside_synchronous_loads_holds": ("judged", ""),
    "test_spec_decode_beside_asynchronous_loads_holds": ("judged", ""),
    "test_spec_decode_beside_loads_cached_past_the_computed_tokens": (
        "violation",
        "Disagreement: engine emitted ('publish', 3, 1, 8)",
    ),
    "test_partial_synchronous_loads_hold": ("judged", ""),
    "test_a_partial_load_registered_past_what_was_written_is_caught": (
        "violation",
        "Disagreement: engine emitted ('publish', 0, 3, 4)",
    ),
    "test_a_partial_load_overrunning_the_budget_is_refused": (
        "run",
        "KV connector: a load not of whole blocks",
    ),
    "test_a_partial_asynchronous_load_is_refused": (
        "run",
        "KV connector: a load not of whole blocks",
    ),
    "test_deferred_loads_hold": ("judged", ""),
    "test_a_deferred_load_freed_at_once_is_caught": (
        "violation",
        "Disagreement: engine emitted ('free', 7), but the spec expects ('finish', 2, 'abort')",
    ),
    "test_whole_prompt_loads_hold": ("judged", ""),
    "test_a_whole_load_recomputing_its_last_block_is_caught": (
        "violation",
        "Illegal: schedule r0 in step 2: token 4 is not known yet",
    ),
}


@needs_vllm
def test_the_plugin_judges_kv_connector_edges(tmp_path: Path) -> None:
    """``case_loads.py``: a KV connector's loads where the attachment used to refuse them,
    judged where the spec covers them (each with a planted bug caught) and refused where it
    does not; without the plugin every case passes."""
    case = str(CASES / "case_loads.py")
    done, tests = _pytest(tmp_path, case, "-p", "kvspec.pytest_plugin")
    assert set(tests) == set(LOADS), done.stdout[-3000:]
    for name, (outcome, what) in LOADS.items():
        entry = tests[name]
        assert entry["outcome"] == outcome, entry
        if outcome == "violation":
            assert entry["finding"].startswith(f"kvspec: {what}"), entry
        elif outcome == "run":
            assert entry["features"] == [what], entry
        else:
            assert entry["events"] > 60, entry
    (tmp_path / "bare").mkdir()
    bare, _ = _pytest(tmp_path / "bare", case, "-p", "no:kvspec.pytest_plugin")
    assert bare.returncode == 0 and f"{len(LOADS)} passed" in bare.stdout, bare.stdout[-3000:]


VENVS = [
    pytest.param(ROOT / name, id=name)
    for name in (".venv-vllm", ".venv-vllm-0.34.0")
    if (ROOT / name / "bin" / "python").exists()
]


def _junit(tmp_path: Path, name: str, *argv: str, venv: Path = VENV) -> tuple[str, dict, dict]:
    """pytest in ``venv`` with a JUnit file: (its output, test -> passed/failed, the report)."""
    junit = tmp_path / f"{name}.xml"
    folder = tmp_path / name
    folder.mkdir()
    done, tests = _pytest(folder, *argv, f"--junitxml={junit}", venv=venv)
    report = folder / "report.json"
    document = json.loads(report.read_text()) if report.exists() else {}
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = any(child.tag in ("failure", "error") for child in case)
        outcomes[case.get("name")] = "failed" if failed else "passed"
    return done.stdout, outcomes, {**document, "tests": tests}


CPU_PLATFORM = ("-p", "kvspec.conformance.adapters.vllm_adapter.cpu_platform")  # 0.34.0 here


@pytest.mark.skipif(not VENVS, reason="no vLLM venv: run `make thirdparty` to build one")
@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_a_crash_inside_kvspec_never_changes_a_test_outcome(tmp_path: Path, venv: Path) -> None:
    """``case_crash.py``: crashes planted in kvspec's wrappers (before and after vLLM's method
    ran), its judge and its attaching; every test's outcome is the one it has without the plugin
    (vLLM's methods called as often, its exceptions unchanged), each crash is counted as an
    internal error, and no manager is kept alive. On kvspec before the safety net, 11 of the 25
    items failed under the plugin (the planted crash raised into the test, and the plugin kept
    a manager alive). Its own sessions, not the shared ones of ``tests/vllm_case_sessions.py``:
    the summary's count of internal errors is over the whole session."""
    case = str(CASES / "case_crash.py")
    _, bare, _ = _junit(tmp_path, "bare", case, "-p", "no:kvspec.pytest_plugin", venv=venv)
    out, judged, report = _junit(tmp_path, "judged", case, "-p", "kvspec.pytest_plugin", venv=venv)
    assert len(bare) == 25 and judged == bare, out[-3000:]
    assert "test_the_plugin_keeps_no_manager_alive[none]" in bare
    assert {n: o for n, o in bare.items() if o != "passed"} in (
        {},  # every supported vLLM
        {f"test_a_scheduler_runs_shared_prefixes[{p}]": "failed" for p in PLANTS},  # a VllmConfig
    ), bare  # a vLLM whose VllmConfig cannot be built on this CPU fails that test either way
    tests = report["tests"]
    assert not [n for n, e in tests.items() if e["outcome"] == "violation"], tests
    for plant in PLANTS[1:]:
        planted = {n: e for n, e in tests.items() if n.endswith(f"[{plant}]")}
        counted = [e for e in planted.values() if e["outcome"] == "error"]
        assert len(counted) >= 3, planted  # counted, never raised into the test
        for entry in counted:
            assert any("a crash planted in kvspec" in e for e in entry["errors"]), entry
    pool = tests["test_a_bare_pool_allocates_and_frees[none]"]
    assert pool["outcome"] == "pool" and pool["events"] > 2, pool  # judged when nothing crashes
    errors = sum(1 for entry in tests.values() if entry["outcome"] == "error")
    assert f"{errors:6d}  kvspec internal errors" in out, out[-3000:]
    assert (report["vllm"] in report["supported"]) == (report["unsupported"] is None), report
    if report["unsupported"]:
        assert f"kvspec: vLLM {report['vllm']} is not a version kvspec supports" in out


PLANTS = ("none", "before", "after", "judge", "attach")

TRIVIAL = "def test_nothing():\n    assert True\n"


def _plain(tmp_path: Path, *argv: str, python: str = sys.executable) -> tuple[str, dict | None]:
    """pytest on a trivial test in ``python``'s environment, kvspec's plugin from its entry point;
    (its output, its --kvspec-report or None)."""
    (tmp_path / "test_trivial.py").write_text(TRIVIAL)
    report = tmp_path / "report.json"
    done = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvspec.pytest_plugin"]
        + ["--rootdir", str(tmp_path), f"--kvspec-report={report}", *argv, "test_trivial.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout, json.loads(report.read_text()) if report.exists() else None


def test_unasked_the_plugin_judges_nothing_and_says_why(tmp_path: Path) -> None:
    out, report = _plain(tmp_path)
    assert report is not None and report["judged"] is False, report
    assert report["reason"].startswith("not asked: pass --kvspec"), report
    assert "kvspec: nothing judged: not asked" in out, out


def test_without_vllm_the_plugin_says_so(tmp_path: Path) -> None:
    """Asked where vLLM cannot be imported (this environment has none): said, and reported."""
    out, report = _plain(tmp_path, "--kvspec")
    assert report is not None and report["judged"] is False, report
    assert report["reason"].startswith("vLLM cannot be imported (ModuleNotFoundError"), report
    assert "kvspec: nothing judged: vLLM cannot be imported" in out, out


def test_an_unsupported_vllm_is_said_once(tmp_path: Path) -> None:
    """A stand-in vLLM of another version (its three classes only), asked by the ini option:
    judged as far as it goes, and the summary says the version is not supported."""
    fake = tmp_path / "fake"
    for module, body in (
        ("vllm/__init__.py", "__version__ = '0.0.1'\n"),
        ("vllm/v1/__init__.py", ""),
        ("vllm/v1/core/__init__.py", ""),
        ("vllm/v1/core/sched/__init__.py", ""),
        ("vllm/v1/core/block_pool.py", "class BlockPool:\n    pass\n"),
        ("vllm/v1/core/kv_cache_manager.py", "class KVCacheManager:\n    pass\n"),
        ("vllm/v1/core/sched/scheduler.py", "class Scheduler:\n    pass\n"),
    ):
        (fake / module).parent.mkdir(parents=True, exist_ok=True)
        (fake / module).write_text(body)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\nkvspec = true\npythonpath = {fake}\n")
    out, report = _plain(tmp_path)
    assert report is not None and report["judged"] is True and report["vllm"] == "0.0.1"
    assert report["unsupported"].startswith("vLLM 0.0.1 is not a version kvspec supports")
    assert out.count("is not a version kvspec supports") == 1, out
    assert "(asked by the ini option kvspec)" in out, out
