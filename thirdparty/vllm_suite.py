"""vLLM's own tests under kvspec's judge (``make vllm-suite``, ``make vllm-suite-ci``), for each
supported release (0.33.0, 0.34.0).

Run with the release's environment's python (``.venv-vllm/bin/python`` for 0.33.0,
``.venv-vllm-0.34.0/bin/python``; standard library only here; pytest and vLLM are that venv's).

``fetch --version V`` (default: the installed vLLM's): vLLM's sdist has the ``tests/`` its wheel
lacks. ``pip download --no-binary :all: --no-deps vllm==V`` fetches it and unpacks it, then fails
building it (the build needs CUDA torch); with ``--no-clean`` and a temporary folder of ours, the
unpacked tree stays, and its ``tests/`` and ``pyproject.toml`` (vLLM's pytest settings) are moved
to the suite folder, which records the version (``VERSION``). ``run`` refuses a suite whose
version is not the installed vLLM's (a release's tests judge that release only).

Both passes load ``kvspec.conformance.adapters.vllm_adapter.cpu_platform`` as a pytest plugin: from
0.34.0 vLLM's CPU platform refuses to build a ``VllmConfig`` on an x86 CPU without triton-cpu,
and that module waives the requirement as 0.33.0 did (``docs/adapters.md``, "vLLM on a CPU
without triton-cpu"); on 0.33.0 it does nothing. The same in both passes, it changes no outcome
between them.

``models``: the model folders the tests name, each a small ``config.json`` (no weights, no
tokenizer: the tests build schedulers and pools, never a model), and ``redirect.json``, which
``VLLM_MODEL_REDIRECT_PATH`` points vLLM at, with ``HF_HUB_OFFLINE=1``.

``run``: pytest over the given test paths twice, without kvspec's plugin (``-p
no:kvspec.pytest_plugin``: not even loaded) and judging with it (``--kvspec``), each writing a
JUnit file; with the plugin also its per-test report (``--kvspec-report``). Then the table: the
baseline (items, passing without the plugin), whether every test's outcome is the same with the
plugin, and the plugin's outcome per test (``pytest_plugin.py``: no Scheduler built, a bare
KVCacheManager or BlockPool judged, refused at construction, stopped mid-run, judged and holding,
violations), with the refusals counted by feature. Exit 1 when an outcome differs or a violation
is found, else 0. ``--parallel`` runs the two passes at the same time (the CI subset on 2 cores);
``--bare-from DIR`` reads the pass without the plugin from an earlier run instead (repeatable: the
union of several runs' passes, or JUnit files, a test in two with differing outcomes refused);
``--also DIR``
joins an earlier run of other test files (both passes and its report) into the table, so the
whole ``tests/v1/core`` can be tabled from the CI subset's run and a run of the rest. ``table
--out DIR [--also DIR ...]`` prints an earlier run's table, joined, without running pytest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import NoReturn

PLATFORM_PLUGIN = "kvspec.conformance.adapters.vllm_adapter.cpu_platform"
THIRDPARTY = Path(__file__).resolve().parent
RECORDS = THIRDPARTY / "vllm-suite-bare"
"""The recorded passes without the plugin of the CI subset, one file per release (``record``)."""
RECORD_INPUTS = ("vllm-requirements.txt", "vllm-suite-requirements.txt", "torch-cpu.txt")
"""What a recorded pass depends on besides the release: the pinned packages of its environment."""
VERSION_FILE = "VERSION"

OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "word_embed_proj_dim": 64,
    "ffn_dim": 128,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
}
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 1,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "torch_dtype": "bfloat16",
}
QWEN3 = dict(
    QWEN2,
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    head_dim=32,
    max_position_embeddings=40960,
    eos_token_id=151645,
)
QWEN3_NEXT = dict(
    QWEN3,
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    num_hidden_layers=4,
    full_attention_interval=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    head_dim=64,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    mlp_only_layers=[],
    max_position_embeddings=262144,
)
CLIP = {
    "model_type": "clip_vision_model",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "image_size": 336,
    "patch_size": 14,
    "projection_dim": 64,
}
LLAVA = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "image_token_index": 32000,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "text_config": dict(LLAMA, vocab_size=32064, architectures=None),
    "vision_config": CLIP,
    "torch_dtype": "float16",
}
QWEN25_VL = dict(
    QWEN2,
    architectures=["Qwen2_5_VLForConditionalGeneration"],
    model_type="qwen2_5_vl",
    max_position_embeddings=128000,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    image_token_id=151655,
    video_token_id=151656,
    vision_config={
        "model_type": "qwen2_5_vl",
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [0],
        "in_chans": 3,
    },
    rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
)
MODELS = {
    "facebook/opt-125m": OPT,
    "facebook/opt-350m": dict(OPT, hidden_size=128, word_embed_proj_dim=64),
    "hmellor/tiny-random-LlamaForCausalLM": LLAMA,
    "llava-hf/llava-1.5-7b-hf": LLAVA,
    "Qwen/Qwen1.5-7B": QWEN2,
    "Qwen/Qwen3-0.6B": QWEN3,
    "Qwen/Qwen3-Next-80B-A3B-Instruct": QWEN3_NEXT,
    "Qwen/Qwen2.5-VL-3B-Instruct": QWEN25_VL,
    "Qwen/Qwen3.5-0.8B": QWEN3,
}
"""The models ``tests/v1/core`` names; only the settings the scheduler and its configs read are
real (context lengths, vocabulary, architecture, attention layout), the sizes are tiny."""

CI_TESTS = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_async_scheduler.py",
)
OUTCOMES = (
    ("none", "no Scheduler built"),
    ("pool", "a bare KVCacheManager / BlockPool, judged and holding"),
    ("pool-refused", "a bare KVCacheManager / BlockPool, refused"),
    ("construction", "refused at construction (a feature the spec cannot express)"),
    ("run", "stopped mid-run (a feature seen only at run time)"),
    ("judged", "judged and holding"),
    ("violation", "violations"),
    ("error", "kvspec internal errors (the test ran unjudged)"),
)


def bad_input(message: str) -> NoReturn:
    """One line on stderr and exit 2 (kvspec's code for bad input)."""
    print(message, file=sys.stderr)
    sys.exit(2)


def installed_version() -> str:
    """The vLLM of this environment (its metadata: vLLM is not imported here)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        bad_input(f"vllm_suite: no vLLM in {sys.prefix}: run it with a vLLM environment's python")


def suite_version(suite: Path) -> str | None:
    marker = suite / VERSION_FILE
    return marker.read_text().strip() if marker.is_file() else None


def fetch(suite: Path, version: str) -> None:
    if (suite / "tests" / "v1" / "core").is_dir():
        have = suite_version(suite)
        if have is None:  # fetched before suites recorded their version: the folder's name says
            have = version if suite.name == f"vllm-{version}" else None
            if have is not None:
                (suite / VERSION_FILE).write_text(have + "\n")
        if have != version:
            bad_input(
                f"vllm_suite: {suite} holds vLLM {have or 'an unknown version'}'s tests, not {version}'s"
            )
        return
    VLLM = f"vllm=={version}"
    suite.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=suite) as tmp:
        env = dict(os.environ, TMPDIR=tmp, PIP_NO_INPUT="1")
        argv = [sys.executable, "-m", "pip", "download", "--no-clean", "--no-binary", ":all:"]
        argv += ["--no-deps", "-d", tmp, VLLM]
        subprocess.run(argv, env=env, capture_output=True, text=True)  # fails at the build
        found = sorted(Path(tmp).glob("*/*/tests/v1/core")) + sorted(
            Path(tmp).glob("*/tests/v1/core")
        )
        if not found:
            sys.exit(f"vllm_suite: pip left no unpacked {VLLM} with tests/ in {tmp}")
        source = found[0].parents[2]
        shutil.move(str(source / "tests"), str(suite / "tests"))
        shutil.copy(source / "pyproject.toml", suite / "pyproject.toml")
        (suite / VERSION_FILE).write_text(version + "\n")


def models(suite: Path) -> Path:
    root = suite / "models"
    redirect = {}
    for name, config in MODELS.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        redirect[name] = str(folder)
    path = root / "redirect.json"
    path.write_text(json.dumps(redirect, indent=1) + "\n")
    return path


def environment(suite: Path) -> dict[str, str]:
    return dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        HF_HOME=str(suite / "hf-home"),
        VLLM_MODEL_REDIRECT_PATH=str(models(suite)),
    )


def pytest_argv(paths: list[str], junit: Path, plugin: bool, report: Path) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    argv += [f"--junitxml={junit}", "-o", "junit_family=xunit1", "-p", PLATFORM_PLUGIN]
    if plugin:
        argv += ["-p", "kvspec.pytest_plugin", "--kvspec", f"--kvspec-report={report}"]
    else:
        argv += ["-p", "no:kvspec.pytest_plugin"]
    return argv


def outcomes(junit: Path) -> dict[str, str]:
    """Test id (file::name) -> passed, failed, error or skipped, from a JUnit file."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        name = f"{file}::{case.get('name')}"
        kinds = [child.tag for child in case]
        result[name] = next(
            (
                k if k != "failure" else "failed"
                for k in ("failure", "error", "skipped")
                if k in kinds
            ),
            "passed",
        )
    return result


def _bare_junit(where: Path) -> Path:
    """The pass without the plugin of an earlier run: its folder's ``junit-bare.xml``, or a JUnit
    file named directly (exit 2 if there is none)."""
    junit = where if where.is_file() else where / "junit-bare.xml"
    if not junit.is_file():
        bad_input(f"vllm_suite: --bare-from {where}: no junit-bare.xml there")
    return junit


def _union_of_outcomes(junits: list[Path]) -> dict[str, str]:
    """Every test of ``junits`` with its outcome; exit 2 on a test two of them saw differently
    (the passes without the plugin are vLLM's alone: a test's outcome there must not vary)."""
    union: dict[str, str] = {}
    for junit in junits:
        for name, outcome in outcomes(junit).items():
            if union.setdefault(name, outcome) != outcome:
                bad_input(
                    f"vllm_suite: --bare-from {junit}: {name} {outcome} there, "
                    f"{union[name]} in an earlier one"
                )
    return union


def _write_outcomes(junit: Path, seen: dict[str, str]) -> None:
    """``seen`` (test id -> outcome) as a JUnit file ``outcomes`` reads back the same: the pass
    without the plugin a run read from earlier passes, kept in its folder like one it ran."""
    root = ET.Element("testsuites", name="read from earlier passes without the plugin")
    suite = ET.SubElement(root, "testsuite", name="pytest", tests=str(len(seen)))
    tags = {"failed": "failure", "error": "error", "skipped": "skipped"}
    for name, outcome in sorted(seen.items()):
        file, _, test = name.partition("::")
        case = ET.SubElement(suite, "testcase", file=file, name=test)
        if outcome != "passed":
            ET.SubElement(case, tags.get(outcome, "error"), message=outcome)
    ET.ElementTree(root).write(junit, encoding="utf-8", xml_declaration=True)


def _inputs_digest() -> str:
    """The pinned packages a pass without the plugin ran with (``RECORD_INPUTS``), hashed."""
    digest = hashlib.sha256()
    for name in RECORD_INPUTS:
        digest.update(name.encode() + b"\0" + (THIRDPARTY / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def record(run_folder: Path, version: str, paths: list[str]) -> int:
    """Save the pass without the plugin of ``run_folder`` (a run over ``paths``, made in this
    environment) as the release's record: what ``run --recorded`` compares the plugin pass with
    instead of running vLLM's tests twice. Refused when that run is not over ``paths``."""
    junit = _bare_junit(run_folder)
    seen = outcomes(junit)
    files = sorted({name.split("::")[0] for name in seen})
    if files != sorted(paths):
        bad_input(f"vllm_suite: record: {junit} ran {files}, not {sorted(paths)}")
    RECORDS.mkdir(exist_ok=True)
    target = RECORDS / f"{version}.json"
    entry = {"vllm": version, "inputs": _inputs_digest(), "paths": sorted(paths), "outcomes": seen}
    target.write_text(json.dumps(entry, indent=0, sort_keys=True) + "\n")
    print(f"recorded {len(seen)} outcomes of vLLM {version}'s {', '.join(paths)} in {target}")
    return 0


def recorded(version: str, paths: list[str]) -> tuple[dict[str, str] | None, str]:
    """The release's recorded pass without the plugin over ``paths`` and why it serves, or
    ``None`` and why not (no record, another release, other pins, other tests): then the
    pass is run, never compared with a record of something else."""
    where = RECORDS / f"{version}.json"
    if not where.is_file():
        return None, f"no record of vLLM {version} ({where})"
    entry = json.loads(where.read_text())
    if entry.get("vllm") != version:
        return None, f"{where} is a record of vLLM {entry.get('vllm')}, not {version}"
    if entry.get("inputs") != _inputs_digest():
        return None, f"{where} was recorded with other pins of {', '.join(RECORD_INPUTS)}"
    if entry.get("paths") != sorted(paths):
        return None, f"{where} records {entry.get('paths')}, not {sorted(paths)}"
    return dict(entry["outcomes"]), f"the pass without the plugin read from {where}"


def run(
    suite: Path,
    paths: list[str],
    out: Path,
    parallel: bool,
    known: dict[str, str] | None = None,
    also: list[Path] | None = None,
) -> int:
    """Both passes over ``paths`` and the table. With ``known`` (test id -> outcome: the pass
    without the plugin of earlier runs, ``--bare-from``, or the recorded one, ``--recorded``) that
    pass is not run again: its outcomes do not depend on kvspec (the plugin is not loaded), so
    this halves the cost of judging a change of kvspec. Its outcomes are taken for the tests this
    run has (a test it lacks counts as differing), so ``paths`` may be a part of what it ran.
    ``also``: earlier runs' folders (of other test files, with the same kvspec) whose two passes
    join this one's in the table: the whole ``tests/v1/core`` is the CI subset's run and a run of
    the rest."""
    out.mkdir(parents=True, exist_ok=True)
    env = environment(suite)
    runs = {
        plugin: (out / f"junit-{'plugin' if plugin else 'bare'}.xml", out / "kvspec-report.json")
        for plugin in (False, True)
        if plugin or known is None
    }
    started = time.monotonic()
    procs = []
    times: dict[bool, float] = {}
    for plugin, (junit, report) in runs.items():
        log = open(out / f"pytest-{'plugin' if plugin else 'bare'}.log", "w")
        argv = pytest_argv(paths, junit, plugin, report)
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=suite, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((plugin, proc, t0))
        if not parallel:
            proc.wait()
            times[plugin] = time.monotonic() - t0
    for plugin, proc, t0 in procs:
        proc.wait()
        times.setdefault(plugin, time.monotonic() - t0)
    times.setdefault(False, 0.0)  # read, not run
    wall = time.monotonic() - started
    for junit, _ in runs.values():
        if not junit.exists():
            sys.exit(f"vllm_suite: pytest wrote no {junit} (see {out})")
    judged = outcomes(runs[True][0])
    if known is not None:  # the tests of this run, as the earlier pass saw them
        bare = {name: known.get(name, "missing from the earlier pass") for name in judged}
        _write_outcomes(out / "junit-bare.xml", bare)  # so ``table``/``--also`` read this run
    else:
        bare = outcomes(runs[False][0])
    report = json.loads(runs[True][1].read_text()) if runs[True][1].exists() else {}
    for earlier in also or ():
        joined = _join(earlier, bare, judged, report)
        print(f"joined {earlier}: {joined} items")
    return table(bare, judged, report, times, wall)


def retable(out: Path, also: list[Path]) -> int:
    """The table of an earlier run (``out``, its two passes and report) joined with ``also``,
    without running pytest (``table``)."""
    bare: dict[str, str] = {}
    judged: dict[str, str] = {}
    report: dict[str, dict[str, object]] = {}
    for folder in (out, *also):
        print(f"joined {folder}: {_join(folder, bare, judged, report)} items")
    return table(bare, judged, report, {False: 0.0, True: 0.0}, 0.0)


def _refuse_overlap(also: list[Path], paths: list[str]) -> None:
    """Before any test runs: exit 2 if an ``--also`` run judged a file that ``paths`` names (or a
    folder of ``paths`` holds), the same refusal ``_join`` makes after the run, without its cost."""
    for earlier in also:
        junit = earlier / "junit-plugin.xml"
        if not junit.is_file():
            bad_input(f"vllm_suite: --also {earlier}: no {junit.name} there")
        for file in sorted({name.split("::")[0] for name in outcomes(junit)}):
            if any(file == p or file.startswith(p.rstrip("/") + "/") for p in paths):
                bad_input(f"vllm_suite: --also {earlier}: {file} is in this run too")


def _join(
    earlier: Path,
    bare: dict[str, str],
    judged: dict[str, str],
    report: dict[str, dict[str, object]],
) -> int:
    """Add an earlier run's outcomes (both passes) and its plugin report to this run's; the
    number of its items. A test in both is bad input: each test is judged once."""
    files = [
        earlier / name for name in ("junit-bare.xml", "junit-plugin.xml", "kvspec-report.json")
    ]
    for path in files:
        if not path.is_file():
            bad_input(f"vllm_suite: --also {earlier}: no {path.name} there")
    more_bare, more_judged = outcomes(files[0]), outcomes(files[1])
    twice = sorted(set(more_bare) & set(bare))
    if twice:
        bad_input(f"vllm_suite: --also {earlier}: {twice[0]} is in this run too")
    bare.update(more_bare)
    judged.update(more_judged)
    tests = report.setdefault("tests", {})
    tests.update(json.loads(files[2].read_text()).get("tests", {}))
    return len(more_bare)


def table(
    bare: dict[str, str],
    judged: dict[str, str],
    report: dict[str, dict[str, object]],
    times: dict[bool, float],
    wall: float,
) -> int:
    passing = sum(1 for o in bare.values() if o == "passed")
    print(f"items: {len(bare)}; passing without the plugin: {passing}")
    without = f"{times[False]:.0f} s" if times[False] else "read from an earlier pass"
    if times[True]:
        print(
            f"time: {without} without the plugin, {times[True]:.0f} s with it "
            f"({wall:.0f} s wall clock)"
        )
    tests = report.get("tests", {})
    kinds: Counter[str] = Counter()
    features: Counter[str] = Counter()
    only: Counter[str] = Counter()
    for name in bare:
        entry = tests.get(name) or tests.get(_short(name)) or {"outcome": "none"}
        kinds[str(entry["outcome"])] += 1
        seen = [str(f) for f in entry.get("features", [])]  # type: ignore[union-attr]
        for feature in set(seen):
            features[feature] += 1
        if len(set(seen)) == 1:
            only[seen[0]] += 1
    differ = [n for n in bare if judged.get(n) != bare[n]]
    print("\n| outcome | tests |\n|---|---|")
    for key, label in OUTCOMES:
        print(f"| {label} | {kinds[key]} |")
    built = len(bare) - kinds["none"]
    held = kinds["pool"] + kinds["judged"]
    if built:
        print(f"\njudged and holding: {held} of {built} items that build one ({held / built:.0%})")
    print("\nrefusals by feature (tests using it; in brackets, tests where it is the only one):")
    for feature, n in features.most_common():
        print(f"  {feature}: {n} ({only[feature]})")
    violations = [n for n in bare if (tests.get(n) or {}).get("outcome") == "violation"]
    for name in violations:
        print(f"VIOLATION {name}: {tests[name].get('finding')}")
    changed = [n for n in differ if n not in violations]
    print(f"\noutcomes that differ with the plugin (violations aside): {len(changed)}")
    for name in changed[:40]:
        print(f"  {name}: {bare[name]} -> {judged.get(name)}")
    return 1 if changed or violations else 0


def _short(name: str) -> str:
    return name.split("/", 1)[-1]


def main() -> int:
    parser = argparse.ArgumentParser(prog="vllm_suite")
    parser.add_argument("command", choices=("fetch", "run", "table", "record"))
    parser.add_argument("--suite", type=Path, required=True, help="the suite folder")
    parser.add_argument(
        "--version", help="the vLLM release whose tests to fetch (default: the installed one)"
    )
    parser.add_argument("--out", type=Path, help="where the run's files go (default SUITE/run)")
    parser.add_argument("--ci", action="store_true", help=f"only {', '.join(CI_TESTS)}")
    parser.add_argument("--parallel", action="store_true", help="both passes at once")
    parser.add_argument(
        "--bare-from",
        type=Path,
        action="append",
        default=[],
        help="an earlier run's folder (or a JUnit file): read its pass without the plugin instead "
        "of running it; repeatable (the union of several)",
    )
    parser.add_argument(
        "--recorded",
        action="store_true",
        help="read the pass without the plugin from this release's record (thirdparty/"
        "vllm-suite-bare/VERSION.json) where it is current; else run it",
    )
    parser.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        help="an earlier run's folder (other test files) joined into the table; repeatable",
    )
    parser.add_argument("paths", nargs="*", default=["tests/v1/core"])
    args = parser.parse_intermixed_args()
    suite = args.suite.resolve()
    installed = installed_version()
    if args.command == "fetch":
        fetch(suite, args.version or installed)
        return 0
    if args.command == "record":  # a run's pass without the plugin, kept for --recorded
        if args.out is None:
            bad_input("vllm_suite: record needs --out, the run's folder")
        paths = list(CI_TESTS) if args.ci else args.paths
        return record(args.out.resolve(), installed, paths)
    if args.command == "table":  # an earlier run's table (with --also), nothing run
        if args.out is None:
            bad_input("vllm_suite: table needs --out, the earlier run's folder")
        return retable(args.out.resolve(), [folder.resolve() for folder in args.also])
    if args.version and args.version != installed:
        bad_input(
            f"vllm_suite: --version {args.version}, but this environment has vLLM {installed}"
        )
    fetch(suite, installed)  # refuses a suite of another release

    paths = list(CI_TESTS) if args.ci else args.paths
    known = None
    if args.bare_from:
        known = _union_of_outcomes([_bare_junit(where.resolve()) for where in args.bare_from])
    elif args.recorded:
        known, why = recorded(installed, paths)
        print(f"vllm_suite: {why}" + ("" if known else ": running it"), flush=True)
    also = [folder.resolve() for folder in args.also]
    _refuse_overlap(also, paths)
    out = (args.out or suite / "run").resolve()
    return run(suite, paths, out, args.parallel, known, also)


if __name__ == "__main__":
    sys.exit(main())
