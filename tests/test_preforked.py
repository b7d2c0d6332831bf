"""``tests/preforked.py`` runs a script as a fresh ``python ARGV`` would: the same exit status,
stdout, stderr, ``sys.argv`` and ``sys.path[0]`` for a script path, ``-m`` and ``-c``; a process
per script, so what one script changes (a module's attribute, the environment) is not seen by the
next; a timeout raised as ``subprocess.TimeoutExpired`` with what the script started killed; one
server per python and environment. Checked on this python with a stdlib module preloaded
(the vLLM environments' own use is the e2e tests')."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import preforked
import pytest

PYTHON = Path(sys.executable)
SCRIPT = """\
import json, os, sys
print("out", json.dumps(sys.argv[1:]), sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("err", getattr(json, "PLANTED", None), os.environ.get("PREFORKED_SEEN"), file=sys.stderr)
json.PLANTED = True
os.environ["PREFORKED_SEEN"] = "yes"
sys.exit(int(sys.argv[1]))
"""
pytestmark = pytest.mark.skipif(
    PYTHON.name != "python" or PYTHON.parent.name != "bin", reason="needs a venv's bin/python"
)


def _both(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], ...]:
    served = preforked.run(PYTHON, argv, cwd=cwd, preload=("json",), timeout=60)
    plain = subprocess.run(
        [str(PYTHON), *argv], capture_output=True, text=True, cwd=cwd, timeout=60
    )
    return served, plain


def test_a_script_runs_as_a_fresh_python_runs_it(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    for code in ("0", "3"):
        served, plain = _both([str(script), code, "x y"], tmp_path)
        assert (served.returncode, served.stdout, served.stderr) == (
            plain.returncode,
            plain.stdout,
            plain.stderr,
        )
        assert served.returncode == int(code)
        assert served.stdout == f'out ["{code}", "x y"] True\n'
        assert served.stderr == "err None None\n"  # nothing left by the run before


def test_m_and_c_and_an_uncaught_exception(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("import sys\nprint(sys.argv, sys.path[0] == '')\n")
    served, plain = _both(["-m", "mod", "a"], tmp_path)
    assert served.returncode == plain.returncode == 0
    assert served.stdout.split(",")[1:] == plain.stdout.split(",")[1:] == [" 'a'] False\n"]
    code = "import sys; print(sys.argv); raise SystemExit('said')"
    served, plain = _both(["-c", code, "b"], tmp_path)
    assert (served.returncode, served.stdout, served.stderr) == (1, "['-c', 'b']\n", "said\n")
    assert (plain.returncode, plain.stdout, plain.stderr) == (1, "['-c', 'b']\n", "said\n")
    served, plain = _both(["-c", "raise ValueError('planted')"], tmp_path)
    assert served.returncode == plain.returncode == 1
    assert served.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1] == "ValueError: planted"


def test_a_timeout_kills_the_script_and_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = (
        "import subprocess, sys, time, pathlib\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        preforked.run(PYTHON, ["-c", code], cwd=tmp_path, preload=("json",), timeout=3)
    assert raised.value.output == "started\n"
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # killed with its group; reaped by init
        state = Path(f"/proc/{grandchild}/stat")
        if not state.exists() or state.read_text().split(")")[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {grandchild} outlived the timeout")


def test_one_server_per_environment(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    for cwd in (tmp_path, tmp_path / "other"):  # the folder is the script's, not the server's
        argv = ["-c", "import os; print(os.getcwd())"]
        done = preforked.run(PYTHON, argv, cwd=cwd, preload=("json",))
        assert done.stdout == f"{cwd}\n"
    env = {**os.environ, "PREFORKED_OTHER": "1"}
    done = preforked.run(
        PYTHON,
        ["-c", "import os; print(os.environ['PREFORKED_OTHER'])"],
        cwd=tmp_path,
        env=env,
        preload=("json",),
    )
    assert done.stdout == "1\n"
    os.environ["PYTEST_CURRENT_TEST"] = "another test (call)"  # not another server's worth
    argv = ["-c", "import os; print(os.environ['PYTEST_CURRENT_TEST'])"]
    done = preforked.run(PYTHON, argv, cwd=tmp_path, preload=("json",))
    assert done.stdout == "another test (call)\n"
    mine = [key for key in preforked._servers if key[0] == str(PYTHON) and key[2] == ("json",)]
    assert len(mine) == 2, mine  # this process's environment (every test above) and the other
    assert all(preforked._servers[key] is not None for key in mine)


def test_a_vllm_script_that_picks_its_device_itself_runs_fresh(tmp_path: Path) -> None:
    """vLLM resolves its platform as it is imported: without ``VLLM_TARGET_DEVICE=cpu`` in the
    environment no server imports it first (the script sets it before its own import)."""
    env = {name: value for name, value in os.environ.items() if name != "VLLM_TARGET_DEVICE"}
    before = set(preforked._servers)  # an earlier test of this worker may have started others
    done = preforked.run(PYTHON, ["-c", "print('fresh')"], cwd=tmp_path, env=env)
    assert done.stdout == "fresh\n"
    assert set(preforked._servers) == before
