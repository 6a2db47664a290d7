"""Start harness runs from a process that has imported TensorFlow once.

``import tensorflow`` costs about 3 s of CPU, more than a small program's whole training run, and
``verify`` runs two programs (the test suite runs a hundred verifies). A *preload server* imports
TensorFlow once and forks one child per run; the child starts from the imported modules and runs
the harness exactly as ``python -m tfmigrate.verify.harness`` would. Importing TensorFlow starts
no runtime, so the child can still set its logical devices up.

What TensorFlow's import reads from the environment (``TF_USE_LEGACY_KERAS`` picks the Keras it
loads) is fixed when the server starts, so there is one server for each setting of the variables
an import can read (:data:`IMPORT_VARIABLES`); the child gets the rest of the run's environment
as it is (a test runner changes ``PYTEST_CURRENT_TEST`` for every test: a server per test held
113 servers and the machine's 23 GiB). At most :data:`MAX_SERVERS` stay up. A server that
cannot start or dies is no error: the run starts as a plain subprocess instead.

A server can also run a plain script (``python SCRIPT ARGV``, :func:`start` with ``script``): the
test suite runs the fixture programs so, beside its verifies.

Set ``TFMIGRATE_VERIFY_PRELOAD=0`` to start every run as a plain subprocess.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from typing import Dict, Optional, Tuple

ENABLE_VARIABLE = "TFMIGRATE_VERIFY_PRELOAD"
#: Prefixes of the environment variables importing TensorFlow (and Python's start) may read.
IMPORT_VARIABLES = ("TF_", "TENSORFLOW", "KERAS", "CUDA", "XLA", "OMP_", "MKL", "KMP_", "PYTHON", "LD_")
#: Servers kept up at once (about 200 MB each): one per Keras flavour is what verify needs, and
#: the test suite runs plain programs in another environment beside them.
MAX_SERVERS = 4
_SERVERS: Dict[Tuple[Tuple[str, str], ...], "Server"] = {}


def enabled() -> bool:
    return os.environ.get(ENABLE_VARIABLE, "1") != "0" and hasattr(os, "fork")


class Server:
    """The client side: one request at a time, as the runner runs one program at a time."""

    def __init__(self, env: Dict[str, str]):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tfmigrate.verify.preload"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """End the server (it ends at the end of its input)."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        self.process.wait()

    def fork(self, argv: list, log: str, env: Dict[str, str], script: Optional[str] = None,
             errors: Optional[str] = None, cwd: Optional[str] = None) -> Optional["ForkedRun"]:
        """Start the harness (or ``script``) with ``argv`` writing to ``log`` (its stderr to
        ``errors`` where given) in ``env`` and ``cwd`` (this process's where None); None when the
        server is gone."""
        request = {"argv": argv, "log": log, "cwd": cwd or os.getcwd(), "env": env, "script": script,
                   "errors": errors}
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            reply = self._reply(None)
        except (BrokenPipeError, OSError, ValueError):
            reply = None
        if not reply or "pid" not in reply:
            self.process.kill()
            return None
        return ForkedRun(self, reply["pid"])

    def _reply(self, timeout: Optional[float]) -> Optional[dict]:
        """The server's next line, None at end of file; raises TimeoutExpired past ``timeout``."""
        if timeout is not None:
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired("preload server", timeout)
        line = self.process.stdout.readline()
        return json.loads(line) if line else None


class ForkedRun:
    """A forked harness run with the part of ``subprocess.Popen`` the runner uses."""

    def __init__(self, server: Server, pid: int):
        self.server = server
        self.pid = pid
        self.returncode: Optional[int] = None

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            reply = self.server._reply(timeout)
            # a server that died mid-run leaves the run's status unknown: report it as failed
            self.returncode = reply["exit"] if reply and "exit" in reply else 1
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(argv: list, log: str, env: Dict[str, str], script: Optional[str] = None,
          errors: Optional[str] = None, cwd: Optional[str] = None) -> Optional[ForkedRun]:
    """Fork ``python -m tfmigrate.verify.harness ARGV`` (``python SCRIPT ARGV`` where ``script`` is
    given, its stderr to ``errors``) from the server for ``env`` (started on first use), in
    ``cwd``; None when no server can run it."""
    key = tuple(sorted((name, value) for name, value in env.items() if name.startswith(IMPORT_VARIABLES)))
    server = _SERVERS.pop(key, None)
    if server is None or not server.alive():
        while len(_SERVERS) >= MAX_SERVERS:
            _SERVERS.pop(next(iter(_SERVERS))).close()  # the least recently used
        server = Server(env)
    _SERVERS[key] = server
    return server.fork(argv, log, env, script, errors, cwd)


def serve() -> None:
    """The server: import TensorFlow, then fork one harness run per request line on stdin and
    answer ``{"pid": ...}`` at its start and ``{"exit": ...}`` at its end."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the import prints must not mix with the replies
    import tensorflow  # noqa: F401 - the point of this process

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n")


def _run_child(request: dict) -> None:
    """In the forked child: a session of its own, the log as stdout and stderr, then the harness."""
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(os.open(request["errors"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if request.get("errors")
                else log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("script"):
            _run_script(request["script"], request["argv"])
        from tfmigrate.verify import harness

        harness.main(request["argv"])  # ends the process
    finally:
        os._exit(1)


def _run_script(script: str, argv: list) -> None:
    """Run ``script`` as `python SCRIPT ARGV` would, and end the process with its exit status."""
    import runpy
    import traceback

    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: B036 - reported as Python reports an uncaught exception
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    serve()
