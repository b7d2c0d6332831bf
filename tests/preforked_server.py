"""The server side of ``tests/preforked.py``: run in a third-party environment's python, it imports
the modules named on its command line once (vLLM's, about 10 s of a core), then runs each script
it is sent in a child forked from that state, as ``python ARGV`` would run it.

Protocol: one JSON request a line on stdin (``argv``, ``cwd``, ``env``, ``out``, ``err``, ``timeout``), one JSON
reply a line on the file descriptor that was stdout at start (``{"rc": N}``, or ``{"timeout":
true}`` after the child's process group was killed). The server's own stdout goes to its stderr
from then on, since vLLM's logger writes to stdout. A child gets ``/dev/null`` as stdin, ``out``
and ``err`` as stdout and stderr, its own session (so a timeout kills what it started), and
leaves through ``os._exit`` after its exit handlers ran, with the code Python would have given.
The server leaves at the end of its stdin (the test process closed it or died).

It only uses the standard library: the environments it runs in are the engines', not kvspec's.
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback


def _exit_code(stop: SystemExit) -> int:
    """The exit status Python gives ``raise SystemExit(code)`` (a message is printed, status 1)."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def _run(argv: list[str]) -> int:
    """``python *argv`` in this process: a script path, ``-m MODULE`` or ``-c CODE``."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            code = compile(argv[1], "<string>", "exec")
            exec(code, {"__name__": "__main__", "__builtins__": builtins})  # noqa: S102
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        return _exit_code(stop)
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught one
        traceback.print_exc()
        return 1


def _child(request: dict, reply_fd: int) -> None:
    """In the forked child: its own session, its streams, the script; never returns."""
    os.setsid()
    os.close(reply_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = _run(request["argv"])
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001,S110 - a closed stream has nothing to flush
                pass
        os._exit(code & 0xFF)


def _wait(pid: int, timeout: float) -> dict:
    """The child's exit status, or its group killed after ``timeout`` seconds (or as soon as the
    test process that asked is gone: nobody is left to read the answer)."""
    deadline, asker = time.monotonic() + timeout, os.getppid()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"rc": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline or os.getppid() != asker:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # not a group of its own yet: the child alone
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.02)


def main() -> None:
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # the server's own output (vLLM's import logs) goes to its stderr
    for name in sys.argv[1:]:
        importlib.import_module(name)
    reply = os.fdopen(reply_fd, "w", buffering=1)
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, reply_fd)
        reply.write(json.dumps(_wait(pid, float(request["timeout"]))) + "\n")


if __name__ == "__main__":
    main()
