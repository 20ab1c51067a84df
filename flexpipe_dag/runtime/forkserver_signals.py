"""The forkserver survives a SIGTERM sent to the head's whole process group; imported by the forkserver only.

A service manager stops a service by signalling every process of it (systemd's default
``KillMode=control-group``; ``kill -TERM -- -PGID`` the same). The stage workers and the driver ignore it
(:func:`~flexpipe_dag.runtime.lifeline.follow_parent`: the head drains, then stops them), but they are
children of ``multiprocessing``'s forkserver, which ignores only SIGINT. Killed, it took the head's view of
its children with it: the head reads a forkserver child's exit status from the server
(``popen_forkserver.Popen.poll``), reads end-of-file, and takes every live stage for one that exited with
status 255, so a server stopping gracefully cut its open streams off with "driver failed".

The forkserver imports :data:`~flexpipe_dag.runtime.pipeline.FORKSERVER_PRELOAD` before it installs its own
handlers; this module, listed there, sets SIGTERM to ignored when (and only when) the forkserver's ``main``
is what imports it. The forkserver still exits when the head does (its "alive" pipe closes) and SIGKILL
still ends it. Its children inherit the setting (it only resets SIGCHLD and SIGINT for them).
"""

from __future__ import annotations

import signal
import sys


def imported_by_forkserver() -> bool:
    """Whether ``multiprocessing.forkserver.main`` is on the stack (the forkserver preloading its modules)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


if imported_by_forkserver():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
