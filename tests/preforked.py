"""Scripts run in a third-party environment's python without paying its engine's import each time:
``run`` is ``subprocess.run([python, *argv], capture_output=True, text=True, ...)`` for the tests,
served by a process of that python that imported the engine once (``tests/preforked_server.py``)
and forks a child per script.

Why: most e2e tests start one process of a vLLM environment per release, and each such process
spends about 10 s of a core importing torch and vLLM (12.6 s of user time for the adapter's import
on the 2-core machine, 10.5 s of it vLLM's own modules) before its check runs for a few seconds:
well over half of ``make test-e2e``'s CPU was those imports. A child forked after the import
starts from it at once.

What stays the same: each script still runs in a process of its own (forked, so nothing a script
sets, patches or plants reaches another), from the same python, working folder and environment
variables (one server per python and environment, since the preloaded modules may read the
environment as they are imported: a test that sets another variable gets a server of its own;
only pytest's ``PYTEST_CURRENT_TEST``, which names each test, is left out of that key and set in
the child), with its own stdin (empty), stdout and stderr, exit status and timeout
(``subprocess.TimeoutExpired``, the child's process group killed). What differs: only the
server imports the preloaded modules, so their import-time output (vLLM's log lines) is not in a
child's output; the checks read their own lines, never those.

The preloaded modules are the engine's own (``VLLM``), never kvspec's: kvspec's adapter sets
environment variables and installs its platform at import, and each script does that itself.
Each pytest process (an xdist worker) keeps its servers until it exits (the server leaves at the
end of its stdin). ``KVSPEC_TESTS_PREFORK=0`` runs every script in a fresh process as before (to
compare, or to rule the server out); a server that fails to start or dies does the same for its
scripts. ``docs/adapters.md`` ("CI") has the figures.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

SERVER = Path(__file__).resolve().with_name("preforked_server.py")
VLLM = (  # vLLM's modules that every vLLM script of the tests imports, one way or another
    "torch",
    "vllm",
    "vllm.config",
    "vllm.sampling_params",
    "vllm.v1.request",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.sched.scheduler",
)
_servers: dict[tuple, subprocess.Popen[str] | None] = {}


VOLATILE = {"PYTEST_CURRENT_TEST"}  # set by pytest for each test: the child's, not the server's


def _key(python: Path, env: Mapping[str, str], preload: Sequence[str]) -> tuple:
    kept = {name: value for name, value in env.items() if name not in VOLATILE}
    return (str(python), tuple(sorted(kept.items())), tuple(preload))


def _server(key: tuple) -> subprocess.Popen[str] | None:
    """The running server of ``key``, started (and waited for) on first use; None where it
    cannot start."""
    if key in _servers:
        server = _servers[key]
        if server is None or server.poll() is None:
            return server
    python, env, preload = key
    log = Path(tempfile.gettempdir()) / f"kvspec-preforked-{os.getpid()}-{len(_servers)}.log"
    with open(log, "w") as stderr:
        server = subprocess.Popen(
            [python, str(SERVER), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=dict(env),
            text=True,
        )
    assert server.stdout is not None
    ready = server.stdout.readline()
    if not ready.strip().startswith("{"):
        server.kill()
        server.wait()
        print(f"preforked: no server for {python} (its log: {log})", file=sys.stderr)
        _servers[key] = None
        return None
    _servers[key] = server
    return server


@atexit.register
def close() -> None:
    """Each server told to leave (the end of its stdin) and waited for, so that its CPU time is
    counted with this process's children (``/usr/bin/time``, ``resource.getrusage``); called at
    the end of the test session (``tests/conftest.py``) and at exit."""
    for key, server in list(_servers.items()):
        _servers.pop(key)
        if server is not None and server.poll() is None:
            assert server.stdin is not None
            server.stdin.close()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _plain(argv: list[str], cwd: Path, env: Mapping[str, str], timeout: float):  # type: ignore[no-untyped-def]
    return subprocess.run(
        argv, capture_output=True, text=True, cwd=cwd, env=dict(env), timeout=timeout
    )


def run(
    python: Path | str,
    argv: Sequence[str],
    *,
    cwd: Path | str,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    preload: Sequence[str] = VLLM,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, *argv], capture_output=True, text=True, cwd=cwd, env=env,
    timeout=timeout)``, run in a child of ``python``'s server for ``preload``. ``argv[0]`` may
    also be a console script of that environment (``bin/kvspec``): it runs as its script."""
    env = dict(os.environ if env is None else env)
    command = [str(python), *argv]
    cwd = Path(cwd)
    if os.environ.get("KVSPEC_TESTS_PREFORK") == "0" or not argv:
        return _plain(command, cwd, env, timeout)
    if Path(python).name != "python" or Path(python).parent.name != "bin":
        return _plain(command, cwd, env, timeout)
    if tuple(preload) == VLLM and env.get("VLLM_TARGET_DEVICE") != "cpu":
        # vLLM resolves its platform as it is imported: a script that picks the device itself
        # (``os.environ.setdefault`` before its first import of vLLM) must import it itself
        return _plain(command, cwd, env, timeout)
    key = _key(Path(python), env, preload)
    server = _server(key)
    if server is None:
        return _plain(command, cwd, env, timeout)
    with tempfile.TemporaryDirectory(prefix="kvspec-preforked-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        request = {"argv": list(argv), "cwd": str(cwd.resolve()), "env": env, "timeout": timeout}
        request |= {"out": str(out), "err": str(err)}
        assert server.stdin is not None and server.stdout is not None
        try:
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            reply = server.stdout.readline()
        except (BrokenPipeError, OSError):
            reply = ""
        if not reply:  # the server died: this script and the next ones in fresh processes
            _servers[key] = None
            return _plain(command, cwd, env, timeout)
        said = json.loads(reply)
        stdout = out.read_text(errors="replace") if out.exists() else ""
        stderr = err.read_text(errors="replace") if err.exists() else ""
    if said.get("timeout"):
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, said["rc"], stdout, stderr)


def run_console(
    venv: Path, script: str, argv: Sequence[str], **how: object
) -> subprocess.CompletedProcess[str]:
    """``venv/bin/SCRIPT *argv`` (a console script such as ``kvspec``), through ``run``."""
    return run(venv / "bin" / "python", [str(venv / "bin" / script), *argv], **how)  # type: ignore[arg-type]
