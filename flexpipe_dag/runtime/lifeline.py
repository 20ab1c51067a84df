"""Pipeline child processes leave with the process that started them.

The driver and the stage workers are ``multiprocessing`` children of the caller (the head), forked
from torch's forkserver or spawned. Without care they outlive a head that is killed: the forkserver
hands each child its own end of the server's "alive" pipe and of the resource tracker's pipe, so a
killed head leaves the forkserver, the resource tracker, the driver and every stage worker running.

:func:`follow_parent` closes that hole from the child's side, whatever killed the head (SIGKILL
and the OOM killer included): ``multiprocessing`` gives each child a sentinel pipe whose other end
only the parent holds, so it reads end-of-file the moment the parent is gone. One daemon thread
waits on it and ends the child at once. With the children gone, the forkserver and the resource
tracker lose their last clients and exit by themselves.

SIGINT and SIGTERM are ignored in the children: a Ctrl-C at a terminal goes to the whole foreground
process group, and so does a service manager's stop (systemd's default ``KillMode=control-group``
sends SIGTERM to every process of the unit; ``kill -TERM -- -PGID`` the same). The head alone decides
how the run stops (it drains or keeps what finished, then kills its children with SIGKILL;
:mod:`flexpipe_dag.runtime.stop`). A child stopped on its own would print a traceback and make the
head report a stage failure instead of the stop: a server sent SIGTERM by process group cut its open
streams off with "driver failed" instead of draining them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

#: Exit status of a child that ends because its parent is gone (nobody is left to read it).
PARENT_GONE_EXIT = 70


def follow_parent() -> bool:
    """In a ``multiprocessing`` child: ignore SIGINT and SIGTERM and exit (status :data:`PARENT_GONE_EXIT`,
    no clean-up: a ``torch.distributed`` peer may be blocked in a collective) as soon as the parent
    process ends. Call first thing in the child's entry point.

    Returns:
        ``True`` when the watch started; ``False`` in a process that has no ``multiprocessing``
        parent (then only SIGINT is ignored: SIGTERM stays how a launcher stops it).
    """
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    if main:  # the head stops its children (SIGKILL after a drain); the lifeline covers a head that is gone
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch() -> None:
        parent.join()  # returns when the parent's end of the sentinel pipe closes: it exited or was killed
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=watch, name="flexpipe-lifeline", daemon=True).start()
    return True
