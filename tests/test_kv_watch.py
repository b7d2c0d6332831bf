"""End to end: vLLM 0.33.0's own ``ZmqEventPublisher`` (``tests/kv_publisher.py``, in
``.venv-vllm``) and ``kvspec watch`` as separate processes on 127.0.0.1, on a clean stream and on
streams with a planted fault; the capture ``watch`` writes is then judged by ``kvspec check
--kv-events`` with the same verdict. Skipped without ``.venv-vllm`` or pyzmq."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
KVSPEC = [sys.executable, "-m", "kvspec"]

pytest.importorskip("zmq")
pytestmark = pytest.mark.skipif(
    not (VENV / ".stamp").exists(), reason="no .venv-vllm: run `make thirdparty` to build it"
)

CASES = {  # fault -> (exit code of watch and check, invariant)
    None: (0, None),
    "lost-frame": (0, None),  # a frame lost live, filled from the replay socket
    "drop-removal": (1, "ViewWithinCapacity"),
    "reorder": (1, "ParentAnnounced"),
    "gap": (1, "SequenceInOrder"),
}


def _seqs(capture: Path) -> set[int]:
    lines = capture.read_text().splitlines()[1:] if capture.exists() else []
    return {json.loads(line).get("seq", -1) for line in lines if line.strip()}


def test_kvspec_watch_judges_vllms_publisher(tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    publisher = subprocess.Popen(
        [str(VENV / "bin" / "python"), "tests/kv_publisher.py"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert publisher.stdin is not None and publisher.stdout is not None
    verdicts = {}
    try:
        for fault, expected in CASES.items():
            publisher.stdin.write(f"open {fault or ''}\n")
            publisher.stdin.flush()
            words = publisher.stdout.readline().split()
            assert words[:1] == ["endpoint"], words
            endpoint, replay = words[1], words[3]
            capture = tmp_path / f"{fault or 'clean'}.jsonl"
            argv = [*KVSPEC, "watch", endpoint, "--replay", replay, "--capture", str(capture)]
            watch = subprocess.Popen(
                [*argv, "--blocks", "7"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            deadline = time.monotonic() + 120
            while not capture.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            publisher.stdin.write("go\n")
            publisher.stdin.flush()
            last = int(publisher.stdout.readline().split()[-1])
            while watch.poll() is None and time.monotonic() < deadline:
                if last in _seqs(capture):  # watch received the last batch
                    time.sleep(0.3)
                    break
                time.sleep(0.1)
            if watch.poll() is None:
                watch.send_signal(signal.SIGINT)
            try:  # generous: on a loaded 2-core CI machine a judge can be starved for a minute
                out, err = watch.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                watch.kill()
                out, err = watch.communicate()
                raise AssertionError(
                    f"kvspec watch did not stop on SIGINT: {err[-2000:]}"
                ) from None
            publisher.stdin.write("close\n")
            publisher.stdin.flush()
            assert publisher.stdout.readline().strip() == "closed"
            check = subprocess.run(
                [*KVSPEC, "check", "--kv-events", str(capture), "--blocks", "7", "--json"],
                capture_output=True,
                text=True,
            )
            report = json.loads(check.stdout)["reports"][0]
            invariant = report.get("violation", {}).get("invariant")
            verdicts[fault] = (watch.returncode, invariant, check.returncode)
            assert (watch.returncode, check.returncode) == (expected[0],) * 2, (fault, out, err)
            assert invariant == expected[1], (fault, out)
            if expected[1] is not None:
                assert f": {expected[1]}: " in out and "minimal history" in out, out
            else:
                assert "holds so far" in err and "batches judged" in err, err
    finally:
        publisher.stdin.close()
        publisher.wait(timeout=60)
    assert len(verdicts) == len(CASES)
