"""The head's side of a stop signal: keep what finished, end every child process, say why.

``kill -TERM`` (a service manager, a launcher, ``timeout``) and Ctrl-C (SIGINT) of a run's head
must not leave the driver and stage workers running, must not lose results that finished, and
must end with a one-line reason and a conventional exit status (``128 + signal``: 130 for SIGINT,
143 for SIGTERM).

:class:`StopSignals` handles both signals while a run is in progress. A signal that arrives while
a :class:`~flexpipe_dag.runtime.pipeline.PipelineRuntime` is attached only sets the runtime's abort
flag (:meth:`~flexpipe_dag.runtime.pipeline.PipelineRuntime.abort`): within a watchdog tick the
waiting call collects the results finished meanwhile (handing them to the sink), kills every
child and raises :class:`~flexpipe_dag.runtime.pipeline.StageFailedError`, which a batch job
records as its failure. Anywhere else (loading the model, reading prompts) the handler raises
:class:`RunStopped` at once. Further signals while stopping are ignored: the stop is bounded
(about two seconds). The children themselves ignore SIGINT and leave with the head however it
ends (:mod:`flexpipe_dag.runtime.lifeline`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any, Protocol

#: The signals a run stops on.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Abortable(Protocol):
    """What :class:`StopSignals` needs of a runtime: a signal-safe ``abort(reason)``."""

    def abort(self, reason: str) -> None: ...


class RunStopped(BaseException):
    """A stop signal arrived outside the runtime's watchdog loop. A ``BaseException``, like
    ``KeyboardInterrupt``, so no ``except Exception`` on the way swallows it.

    Attributes:
        signum: the signal number.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)}")


def signal_name(signum: int) -> str:
    """``15`` -> ``"SIGTERM"`` (``"signal N"`` for a number Python does not name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """Context manager: SIGINT and SIGTERM stop the run cleanly while it is active; the previous
    handlers come back on exit. Installed only from the main thread (Python runs signal handlers
    there); elsewhere it is inert and :attr:`signum` stays ``None``.

    Attributes:
        signum: the first stop signal received, else ``None``.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._runtime: Abortable | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._runtime = None

    @property
    def stopped(self) -> bool:
        """Whether a stop signal arrived."""
        return self.signum is not None

    @property
    def reason(self) -> str:
        """``"stopped by SIGTERM"`` (empty before a signal)."""
        return f"stopped by {signal_name(self.signum)}" if self.signum is not None else ""

    @property
    def exit_status(self) -> int:
        """The conventional exit status, ``128 + signal`` (130 SIGINT, 143 SIGTERM); 0 before a signal."""
        return 128 + self.signum if self.signum is not None else 0

    def attach(self, runtime: Abortable) -> None:
        """Route a stop signal to ``runtime.abort`` from now on (at once if one already arrived)."""
        self._runtime = runtime
        if self.signum is not None:
            runtime.abort(self.reason)

    def detach(self) -> None:
        """Back to raising :class:`RunStopped` on a stop signal (the runtime is shut down)."""
        self._runtime = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            return  # already stopping, and the stop is bounded: a second Ctrl-C changes nothing
        self.signum = signum
        if self._runtime is not None:
            self._runtime.abort(self.reason)
            return
        raise RunStopped(signum)
