"""A lane: one live :class:`~flexpipe_dag.runtime.pipeline.PipelineRuntime` plus the thread that pumps it.

The runtime's events (results, metrics, refusals, failures) are read by whoever calls its
``wait``; a lane gives each runtime exactly one such reader, its *pump* thread, so two pipelines
serve side by side (the old gear draining while the new one takes traffic). The pump calls
``runtime.wait`` whenever the ledger says requests are open on this lane, and ``runtime.poll``
while none is (so an idle pipeline's samples keep coming and a stage that dies idle is found at
once), hands results and metric samples to its owner (a :class:`LaneOwner`: the
:class:`~flexpipe_dag.shift.router.ServingRouter`), reports the runtime's refusals after each
``wait`` (and whenever :meth:`Lane.poll_refusals` is called), and reports a
:class:`~flexpipe_dag.runtime.pipeline.StageFailedError` (crash, raise, or the runtime's watchdog)
to the owner, which moves the lane's unfinished requests elsewhere. The lane knows its owner only
through :class:`LaneOwner`, so this module does not import the router.

Everything else that reads the runtime's events (``reconfigure``, ``shutdown``) runs only while
the pump is parked (:meth:`Lane.run_exclusive`, :meth:`Lane.retire`), so no event is read twice
or lost. A lane that must die at once (rollback of a sick gear) is stopped by killing its stage
processes (:meth:`Lane.force_stop`): the pump's ``wait`` then fails through the runtime's own
watchdog and the router moves what was open.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Literal, Protocol

from flexpipe_dag.shift.ledger import RequestLedger, request_work_tokens

if TYPE_CHECKING:  # pragma: no cover
    from flexpipe_dag.runtime.pipeline import PipelineRuntime

LaneState = Literal["warming", "active", "draining", "standby", "retired", "failed"]
#: What a refusal by this lane's runtime means: tell the caller (``final``), keep the request for
#: a later re-submission (``park``: a degraded KV pool that will grow), or a failed health check
#: (``fail``: the request is parked and the lane marked unhealthy).
RefusalPolicy = Literal["final", "park", "fail"]
#: How long an idle pump waits for an event of its runtime at a time, seconds: a request submitted
#: meanwhile is read as soon as its first event comes (the same call handles it).
IDLE_POLL_S = 0.02


class LaneOwner(Protocol):
    """What a :class:`Lane` needs from whoever owns it (the
    :class:`~flexpipe_dag.shift.router.ServingRouter` implements it). The lane calls these from its
    pump thread (and from :meth:`Lane.run_exclusive`, :meth:`Lane.retire`, :meth:`Lane.force_stop`).

    Attributes:
        ledger: the :class:`~flexpipe_dag.shift.ledger.RequestLedger` recording which lane holds each
            request; the lane asks it what is open and records finished outputs in it.
    """

    ledger: RequestLedger

    def lane_failed(self, lane: Lane, err: BaseException) -> None:
        """``lane``'s runtime failed with ``err`` (a ``StageFailedError``, or a bug); move its open requests."""

    def lane_gone(self, lane: Lane) -> None:
        """``lane`` was retired or killed; move whatever is still open on it."""

    def lane_refused(self, lane: Lane, refusals: dict[str, str]) -> None:
        """``lane``'s runtime refused these requests (request id -> reason), each reported once."""

    def lane_metrics(self, lane: Lane, sample: Any, *, idle: bool) -> None:
        """A :class:`~flexpipe_dag.core.metrics.MetricSample` of ``lane``'s runtime; ``idle``: read while the
        lane had no request open (its window may be empty)."""

    def lane_tokens(self, lane: Lane, tokens: tuple[tuple[str, int, int], ...]) -> None:
        """Tokens one step of ``lane``'s runtime sampled, ``(request_id, index, token_id)`` each (streaming)."""


class Lane:
    """One started pipeline runtime, its pump thread and its place in the router.

    Args:
        lane_id: unique name, ``"<gear_id>#<n>"``.
        runtime: the started :class:`PipelineRuntime`.
        owner: the :class:`LaneOwner` told of results, metrics, refusals and failures.

    Attributes:
        lane_id: unique name, ``"<gear_id>#<n>"``.
        runtime: the started :class:`PipelineRuntime`.
        state: ``warming`` (shadow, probes only), ``active`` (requests are routed to it: the entry point,
            or a further instance beside it), ``draining``
            (no new admissions, in-flight requests finish), ``standby`` (drained, kept alive as the
            rollback target), ``retired`` (processes stopped), ``failed``.
        failure: the :class:`StageFailedError` that ended it, if any.
        health_failure: the first failed health finding (a refusal under policy ``fail``).
    """

    def __init__(self, lane_id: str, runtime: PipelineRuntime, owner: LaneOwner):
        self.lane_id, self.runtime, self.owner = lane_id, runtime, owner
        self.state: LaneState = "warming"
        self.refusal_policy: RefusalPolicy = "final"
        self.failure: BaseException | None = None
        self.health_failure: str | None = None
        self.forced = False  # force_stop() was called: the failure it causes is ours, not the gear's
        self._stop = threading.Event()
        self._rt_lock = threading.Lock()  # held by the pump while it is inside runtime.wait / poll
        self._exclusive_wanted = threading.Event()  # the pump stays off the lock (a lock is not fair)
        self._refusal_lock = threading.Lock()
        self._refusal_cursor = 0  # runtime.refusals_since's cursor: refusals already handed to the owner
        self._thread = threading.Thread(target=self._pump, name=f"flexpipe-lane-{lane_id}", daemon=True)

    @property
    def gear(self):
        return self.runtime.gear

    @property
    def alive(self) -> bool:
        return self.state not in ("retired", "failed")

    def start_pump(self) -> None:
        self._thread.start()

    def can_hold(self, request: Any) -> bool:
        """Whether this lane's pipeline can ever serve ``request``: its prompt + ``max_new_tokens`` within
        the runtime's :attr:`~flexpipe_dag.runtime.pipeline.PipelineRuntime.longest_request_tokens` (its
        context and one lane of its KV pool), after the prompt is cut to the context when the runtime
        truncates (``RuntimeOptions.truncate_context``)."""
        rt = self.runtime
        tokens = request_work_tokens(request)
        context = rt.max_context_tokens
        if rt.options.truncate_context and context is not None and request.max_new_tokens < context:
            tokens = min(tokens, context)
        return tokens <= rt.longest_request_tokens

    # -- pump ---------------------------------------------------------------------------------------
    def _pump(self) -> None:
        from flexpipe_dag.runtime.pipeline import StageFailedError

        ledger = self.owner.ledger
        while not self._stop.is_set():
            # (a cancelled request is not open, but its abort is still to collect)
            busy = ledger.has_open(self.lane_id) or self.runtime.num_outstanding
            if self._exclusive_wanted.is_set():
                time.sleep(0.005)
                continue
            if not self._rt_lock.acquire(timeout=0.05):
                continue
            t0, handled = time.monotonic(), 0
            err: BaseException | None = None
            try:
                if self._stop.is_set():
                    pass  # retire / force_stop own the runtime now
                elif busy:
                    self.runtime.wait(on_result=self._on_result, on_metrics=self._on_metrics,
                                      on_tokens=self._on_tokens)
                else:  # idle: keep reading, so the samples go on (zero load) and a dead stage is found now
                    handled = self.runtime.poll(IDLE_POLL_S, on_result=self._on_result,
                                                on_metrics=self._on_idle_metrics, on_tokens=self._on_tokens)
            except BaseException as exc:
                err = exc
            finally:
                self._rt_lock.release()
            if err is not None:
                if self.forced and not busy:  # force_stop killed an idle lane: its own doing, it retires it
                    return
                self.failure = err
                if not isinstance(err, StageFailedError):  # a bug, not the runtime's watchdog: stop it
                    with suppress(Exception):
                        self.runtime.shutdown(timeout_s=2.0)
                self.owner.lane_failed(self, err)
                return
            if busy or handled:  # (the router's monitor polls refusals too)
                self.poll_refusals()
            if busy and time.monotonic() - t0 < 0.005:  # accepted by the ledger, not yet submitted to the runtime
                time.sleep(0.005)

    def _on_result(self, out: Any) -> None:
        self.owner.ledger.finish(out, self.lane_id)

    def _on_metrics(self, sample: Any) -> None:
        self.owner.lane_metrics(self, sample, idle=False)

    def _on_idle_metrics(self, sample: Any) -> None:
        self.owner.lane_metrics(self, sample, idle=True)

    def _on_tokens(self, tokens: tuple[tuple[str, int, int], ...]) -> None:
        self.owner.lane_tokens(self, tokens)

    def poll_refusals(self) -> int:
        """Hand the runtime's new refusals to the owner (each once); returns how many were new."""
        with self._refusal_lock:
            fresh, self._refusal_cursor = self.runtime.refusals_since(self._refusal_cursor)
        if fresh:
            self.owner.lane_refused(self, fresh)
        return len(fresh)

    # -- exclusive use, stop ------------------------------------------------------------------------
    def run_exclusive(self, fn: Callable[[PipelineRuntime], Any], timeout_s: float) -> Any:
        """Run ``fn(runtime)`` (e.g. ``reconfigure``) once no request is open on this lane and the
        pump is parked. The caller must first stop new submissions to this lane (router hold).

        Raises:
            TimeoutError: the lane did not empty within ``timeout_s``.
            StageFailedError: ``fn`` failed the runtime; the owner has been told (open requests moved).
        """
        from flexpipe_dag.runtime.pipeline import StageFailedError

        deadline = time.monotonic() + timeout_s
        # a cancelled request is no longer open, but its abort is still on its way: wait for that too
        while self.owner.ledger.has_open(self.lane_id) or self.runtime.num_outstanding:
            if self.failure is not None:
                raise self.failure
            if time.monotonic() > deadline:
                raise TimeoutError(f"lane {self.lane_id} still had {self.owner.ledger.num_open(self.lane_id)} "
                                   f"open requests ({self.runtime.num_outstanding} in its pipeline, cancelled ones "
                                   f"included) after {timeout_s:.1f} s")
            time.sleep(0.02)
        self._exclusive_wanted.set()
        try:
            if not self._rt_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"lane {self.lane_id}: pump did not park within {timeout_s:.1f} s")
            try:
                return fn(self.runtime)
            except StageFailedError as err:
                self.failure = err
                self._stop.set()
                self.owner.lane_failed(self, err)
                raise
            finally:
                self._rt_lock.release()
        finally:
            self._exclusive_wanted.clear()

    def retire(self, timeout_s: float = 30.0) -> None:
        """Stop the pump and shut the runtime down (drains in-flight work, then stops every process).
        Call once no request is open on the lane; anything still open is moved by the router."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)
        if self.state != "failed":
            self.runtime.shutdown(timeout_s=timeout_s)
            self.state = "retired"
        self.owner.lane_gone(self)

    def force_stop(self, join_timeout_s: float = 10.0) -> None:
        """Kill the lane now: SIGKILL its stage processes (the pump's ``wait`` then fails through the
        runtime's watchdog, which also kills the driver), then shut down whatever is left. Open
        requests are moved by the router to the active lane (or held)."""
        self.forced = True
        self._stop.set()
        if self.state not in ("retired", "failed"):
            for pid in self.runtime.stage_pids():
                with suppress(ProcessLookupError, TypeError):
                    os.kill(pid, signal.SIGKILL)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=join_timeout_s)
        with suppress(Exception):
            self.runtime.shutdown(timeout_s=1.0)
        if self.state != "failed":
            self.state = "retired"
        self.owner.lane_gone(self)
