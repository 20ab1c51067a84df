"""One pipeline runtime per host: an exclusive OS file lock (``flock`` through :mod:`filelock`) held for
as long as a runtime-starting op runs.

Dagster's concurrency pool ``pipeline_runtime`` queues such ops and shows the queue in the UI, but its
slot claim is not atomic on every storage: on SQLite (Dagster 1.13) a step counts the free slots, then
inserts itself as assigned, then selects a free slot row and updates it without re-checking that the
row is still free, so two runs starting together can both be told they hold the single slot (seen in
CI). The kernel's ``flock`` has no such window, and it is released when the holding process dies, even
by ``SIGKILL``, so a killed run never keeps the runtime. The lock is therefore what guarantees one
runtime per host; the pool is what queues and shows the waiting runs.

The lock file is ``$FLEXPIPE_RUNTIME_LOCK`` or ``$FLEXPIPE_HOME/pipeline_runtime.lock``. Point
``FLEXPIPE_RUNTIME_LOCK`` at one host-wide path (for example ``/run/flexpipe/pipeline_runtime.lock``)
when several FlexPipe homes share the host's devices. Beside it, ``<lock>.holder`` names the holder
(run, pid, since when) so a waiting run can say whom it waits for; it is informational only.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: Environment variable naming the lock file (default ``$FLEXPIPE_HOME/pipeline_runtime.lock``).
LOCK_ENV = "FLEXPIPE_RUNTIME_LOCK"
#: How often a waiting run says again whom it waits for, seconds.
WAIT_REPORT_EVERY_S = 60.0
#: How long one blocking attempt lasts before the wait is reported, seconds.
POLL_S = 0.5


def runtime_lock_path() -> Path:
    """The host's pipeline-runtime lock file (its directory created if missing)."""
    from flexpipe_dag.core.settings import flexpipe_home

    raw = os.environ.get(LOCK_ENV)
    path = Path(raw).expanduser() if raw else flexpipe_home() / "pipeline_runtime.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _holder_path(lock: Path) -> Path:
    return lock.with_name(lock.name + ".holder")


def describe_holder(lock: Path) -> str:
    """Who holds ``lock``, as its holder file says ("an unknown process" when it says nothing readable)."""
    try:
        info = json.loads(_holder_path(lock).read_text())
        return (f"{info['owner']} (pid {info['pid']} on {info['host']}, since "
                f"{time.strftime('%H:%M:%S', time.localtime(float(info['since'])))})")
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process"


@contextmanager
def hold_runtime_lock(owner: str, on_wait: Callable[[str], None], path: Path | None = None,
                      report_every_s: float = WAIT_REPORT_EVERY_S) -> Iterator[float]:
    """Hold the host's pipeline-runtime lock for the body of the ``with``; wait for it first if it is held.

    Args:
        owner: who takes it, as a waiting run will name it (e.g. ``"Dagster run 1a2b3c4d (serve)"``).
        on_wait: called with one line when the lock is found held, then every ``report_every_s``
            seconds while the wait lasts (a Dagster op passes ``context.log.info``).
        path: the lock file; :func:`runtime_lock_path` when None.
        report_every_s: seconds between two wait reports.

    Yields:
        The seconds spent waiting for the lock (0.0 when it was free).

    The wait has no deadline, like a run queued on a Dagster pool: stop the waiting run to give up.
    The lock is released when the body ends, raises, or the process dies.
    """
    import filelock

    lock_path = path or runtime_lock_path()
    lock = filelock.FileLock(str(lock_path))
    start = time.monotonic()
    last_report: float | None = None
    while True:
        try:
            lock.acquire(timeout=POLL_S)
            break
        except filelock.Timeout:
            now = time.monotonic()
            if last_report is None or now - last_report >= report_every_s:
                waited = f" ({now - start:.0f} s so far)" if last_report is not None else ""
                on_wait(f"waiting for the pipeline runtime on this host: lock {lock_path} is held by "
                        f"{describe_holder(lock_path)}{waited}")
                last_report = now
    waited_s = time.monotonic() - start if last_report is not None else 0.0  # 0.0: it was free
    holder = _holder_path(lock_path)
    try:
        tmp = holder.with_name(holder.name + f".{os.getpid()}")
        tmp.write_text(json.dumps({"owner": owner, "pid": os.getpid(), "host": socket.gethostname(),
                                   "since": time.time()}))
        tmp.replace(holder)
        yield waited_s
    finally:
        holder.unlink(missing_ok=True)
        lock.release()
