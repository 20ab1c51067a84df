"""The front door's CPU priority under the stage workers'.

A decode step is on the critical path of every stream in its micro-batch; the front door's work for one
token (an SSE chunk to write, a client's parse) is on one stream's. When the host's cores are all busy
(a CPU pipeline, or a GPU host whose launch threads fill its cores), the kernel shares them evenly, and the
front door's per-token work at C streams lands on every step: measured on the 2-core lab host at 4 clients,
+5 to +10 ms per output token with the front door at the stage workers' priority, -8 to +2 ms with its
event-loop thread at nice +10 (issue #14's bench, round pairs). At nice +10 a thread still gets about a
tenth of a busy core (CFS weights 1024 against 110), so the front door is slowed, never starved; with a
free core the nice value changes nothing.

Linux keeps a nice value per thread (``setpriority(2)``, NOTES), and a thread or process starts with its
creator's: lower the calling thread *after* the stage processes exist. Pipelines started later from a
lowered thread inherit it under the ``spawn`` start method; under ``forkserver`` (the default) they fork
from the server process started with the first pipeline, at its priority.
"""

from __future__ import annotations

import os
import threading

#: ``nice(2)``'s range: 19 is the lowest priority.
MAX_NICE = 19


def lower_thread_priority(increment: int) -> int | None:
    """Raise the calling thread's nice value by ``increment`` (capped at :data:`MAX_NICE`), so the
    kernel favours every other thread of this host at its old priority when cores are short.

    Args:
        increment: nice steps, 0..19 (0: nothing changes).

    Returns:
        The thread's nice value now, or None where the platform keeps no per-thread priority (not Linux)
        or refused the change (nothing changed then).

    Raises:
        ValueError: ``increment`` outside 0..19.
    """
    if not 0 <= increment <= MAX_NICE:
        raise ValueError(f"increment: expected 0..{MAX_NICE}, got {increment}")
    if not hasattr(os, "setpriority") or not os.uname().sysname == "Linux":
        return None
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if increment:
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + increment))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # a sandbox without setpriority: serve at the priority we have
        return None
