"""``pip install kvspec`` as a user gets it: the wheel built from this checkout (with the fast model
compiled by mypyc, setup.py) installed into a fresh virtual environment outside the checkout,
without torch, runs ``kvspec check`` (with the compiled model, no note), ``kvspec fuzz`` and
``kvspec prove``. Prints the environment's size and the timings (``pytest -s`` shows them).

pip resolves the dependencies from its cache and the configured indexes (no download for what is
already cached). The build uses this environment's setuptools and mypy (no build isolation).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIZE_TARGET = 300 << 20


def _copy_checkout(to: Path) -> None:
    """The files git would ship (tracked and new, not ignored): a clean source tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / name.decode()
        if source.is_file():
            target = to / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.mark.packaging
def test_the_wheel_installs_and_runs_in_a_fresh_environment(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    times: dict[str, float] = {}

    def timed(name: str, argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, **kw)  # type: ignore[call-overload]
        times[name] = time.monotonic() - started
        return done  # type: ignore[no-any-return]

    source, dist, venv, work = (tmp_path / n for n in ("src", "dist", "venv", "work"))
    _copy_checkout(source)
    work.mkdir()
    pip = [sys.executable, "-m", "pip"]
    built = timed("build", [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)])  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("kvspec-*.whl")
    made = timed("venv", [sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = timed(
        "install", [*pip, "--python", str(python), "install", "--no-compile", f"{wheel}[proofs]"]
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    size = _size(venv)
    kvspec = [str(venv / "bin" / "kvspec")]
    env = {"PATH": str(venv / "bin"), "HOME": str(tmp_path), "KVSPEC_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    missing = subprocess.run([str(python), "-c", "import torch"], capture_output=True, env=env)
    assert missing.returncode != 0  # no torch, no triton, no transformers

    sim = timed("simulate", kvspec + ["simulate", "--policy", "deferred", "--format", "v1", "--out", "t.jsonl"], cwd=work, env=env)  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    checked = timed("check", kvspec + ["check", "--json", "t.jsonl"], cwd=work, env=env)
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout)["reports"][0]
    assert "note" not in report, report  # the compiled fast model judged
    fuzzed = timed("fuzz", kvspec + ["fuzz", "--policy", "eager-unsafe", "--discipline", "general", "--seconds", "5", "--out", "cex.jsonl"], cwd=work, env=env)  # fmt: skip
    assert fuzzed.returncode == 1 and "witness: r" in fuzzed.stdout, fuzzed.stdout + fuzzed.stderr
    assert timed("check cex", kvspec + ["check", "cex.jsonl"], cwd=work, env=env).returncode == 1
    proved = timed("prove", kvspec + ["prove", "--policy", "deferred", "--blocks", "3", "--requests", "1", "--depth", "1"], cwd=work, env=env)  # fmt: skip
    assert proved.returncode == 0 and "PROVED" in proved.stdout, proved.stdout + proved.stderr
    replay = timed("replay", kvspec + ["replay", "cex.jsonl"], cwd=work, env=env)
    assert replay.returncode == 2 and "kvspec[tensors]" in replay.stderr
    assert sorted(p.name for p in work.iterdir()) == [
        "cex.jsonl",
        "cex.jsonl.perfetto.json",
        "t.jsonl",
    ]
    print(f"\nfresh environment: {size / 2**20:.0f} MiB (target < 300 MiB); seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))  # fmt: skip
    assert size < SIZE_TARGET
