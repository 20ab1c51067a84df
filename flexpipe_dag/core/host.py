"""Facts about the local host shared by the probe and the runtime."""

from __future__ import annotations

import os
import socket


def host_memory_bytes() -> int:
    """Physical memory of this host, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def process_stopped(pid: int) -> bool:
    """Whether the OS reports process ``pid`` stopped (Linux ``/proc/<pid>/stat`` state ``T`` or
    ``t``: SIGSTOP, a debugger, a frozen cgroup). False when unknown (another OS, a gone process)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)  # the command name may hold spaces and parentheses
    return len(fields) == 2 and fields[1].split()[:1] in (["T"], ["t"])


def local_cluster_id() -> str:
    """The id a probe of this host gives its cluster by default: the host name."""
    return socket.gethostname()


def cpu_worker_device_id(host: str, rank: int) -> str:
    """Device id of CPU worker process ``rank`` on ``host``, as the probe names it (``<host>-cpu<rank>``)."""
    return f"{host}-cpu{rank}"
