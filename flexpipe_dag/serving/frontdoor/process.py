"""A ``flexpipe serve`` process started and stopped by another program (a Dagster op, a test, a bench).

The server is the one users run: a child process of this Python (``python -m flexpipe_dag.cli serve``),
its stderr kept line by line (and passed to ``on_line``) so a caller can show what it logged; its URL
read from uvicorn's "running on" line (``--port 0`` lets the kernel pick a free port). SIGTERM drains it,
as a supervisor would.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from flexpipe_dag.core.errors import InfeasibleError

_RUNNING = re.compile(r"Uvicorn running on (http://\S+)")


class ServerProcess:
    """``flexpipe serve ARGS`` in a child process.

    Args:
        args: the ``serve`` arguments (``["--gear", "latency", "--port", "0", ...]``).
        env: variables set over this process's environment.
        cwd: its working directory (default: this one).
        on_line: called with each stderr line (without its newline), from a reader thread.
        command: the whole command line instead of ``python -m flexpipe_dag.cli serve ARGS`` (``args`` is then
            ignored): a program that runs a :class:`~flexpipe_dag.serving.frontdoor.server.FrontDoorServer`
            itself.
        new_session: start it in its own session and process group (``os.killpg(proc.pid, sig)`` then signals it
            and its stage workers, as a service manager stopping it does).

    Attributes:
        lines: every stderr line so far.
        url: ``http://HOST:PORT`` once bound (``None`` before).
    """

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                 on_line: Callable[[str], None] | None = None, command: Sequence[str] | None = None,
                 new_session: bool = False):
        argv = list(command) if command is not None else [sys.executable, "-m", "flexpipe_dag.cli", "serve", *args]
        self.proc = subprocess.Popen(argv, cwd=cwd,
                                     env={**os.environ, **(env or {})}, stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, start_new_session=new_session)
        self.lines: list[str] = []
        self.url: str | None = None
        self.on_line = on_line
        self._bound = threading.Event()
        self._reader = threading.Thread(target=self._read, name="flexpipe-serve-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.rstrip("\n")
            self.lines.append(line)
            if self.on_line is not None:
                self.on_line(line)
            found = _RUNNING.search(line)
            if found and self.url is None:
                self.url = found.group(1).rstrip("/")
                self._bound.set()
        self._bound.set()  # the process ended: wait_bound stops waiting

    def wait_bound(self, timeout_s: float = 300.0) -> str:
        """Wait until the server accepts connections; returns its ``/v1`` base URL.

        Raises:
            InfeasibleError: it exited first, or was not up within ``timeout_s`` (its last log lines quoted).
        """
        self._bound.wait(timeout_s)
        if self.url is None:
            code = self.proc.poll()
            why = f"exited with status {code}" if code is not None else f"was not up within {timeout_s:.0f} s"
            raise InfeasibleError(f"flexpipe serve {why}: " + " | ".join(self.lines[-8:]))
        return self.url + "/v1"

    def stop(self, timeout_s: float = 180.0) -> int:
        """SIGTERM (drain, then stop the pipeline) and wait for the exit status; SIGKILL after ``timeout_s``.

        Returns 0 for a clean stop (the server drains, releases the host's runtime lock and exits); 1 when
        the pipeline had failed; ``-9`` when it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(timeout=10)
        return code
