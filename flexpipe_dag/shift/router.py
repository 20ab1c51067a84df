"""The serving front: one entry point for online and offline requests over the live pipeline(s).

:class:`ServingRouter` owns the lanes (:mod:`~flexpipe_dag.shift.lane`: one live pipeline runtime
each) and a :class:`~flexpipe_dag.shift.ledger.RequestLedger`. Every request goes through
:meth:`ServingRouter.submit`; the router puts it on the *active* lane (the entry point), or holds
it while the entry point is closed (a cold shift, a KV-pool growth, no live pipeline). Each
request's output reaches ``on_result`` exactly once.

Switching the entry point (:meth:`ServingRouter.switch_to`) is atomic: submission and switch
take the same lock, so every request lands on exactly one lane, either the old gear (where it
finishes) or the new one. When a lane fails (crashed / raising / hung stage, reported by its
pump), its delivered outputs are kept, and every request it held that did not finish is
re-submitted: to the *fallback* lane if the failed lane was the entry point and a fallback is
set (the executor's double buffer: traffic returns to the old gear), to the entry point if the
failed lane was not it (e.g. an old gear that died while draining), or held until a pipeline is
opened (:meth:`ServingRouter.open`) when nothing is left.

Priorities: requests carry their own ``priority`` (0 online, larger offline); each runtime's
scheduler admits online first. The router does not reorder them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.shift.lane import Lane, LaneState
from flexpipe_dag.shift.ledger import INTERNAL_PREFIX, LedgerEntry, Probe, RequestLedger

if TYPE_CHECKING:  # pragma: no cover
    from flexpipe_dag.core.metrics import MetricSample
    from flexpipe_dag.runtime.pipeline import PipelineRuntime
    from flexpipe_dag.runtime.scheduler import Request, RequestOutput

#: How often the monitor thread collects refusals from lanes whose pump is busy, seconds.
REFUSAL_POLL_S = 0.25


class ServingRouter:
    """Entry point over live pipelines, with exactly-once delivery. Use as a context manager.

    It implements its lanes' :class:`~flexpipe_dag.shift.lane.LaneOwner` (``lane_failed``, ``lane_gone``,
    ``lane_refused``, ``lane_metrics`` are called from lane threads).

    Args:
        on_result: ``RequestOutput -> None``, called once per caller request (in a pump thread).
        on_refused: ``(request_id, reason) -> None`` for requests no pipeline will serve (e.g.
            prompt + ``max_new_tokens`` - 1 KV tokens more than one lane of the KV pool holds).
        on_metrics: ``MetricSample -> None``, every live pipeline's samples (``gear_id`` tells which).
        on_tokens: ``(request_id, index, token_id) -> None`` for every token a caller request's
            pipeline sampled, as it comes (runtimes started with ``stream_tokens``). A request moved to
            another lane (a failure, a cold shift) starts again there, so an ``index`` can come twice:
            a streaming caller keeps the first and sends each index once.

    Attributes:
        ledger: the :class:`RequestLedger`.
        failures: ``(lane_id, reason)`` of every lane that failed, oldest first.
        fallback: the lane traffic returns to if the active lane fails (set by the executor).
    """

    def __init__(self, on_result: Callable[[RequestOutput], None] | None = None,
                 on_refused: Callable[[str, str], None] | None = None,
                 on_metrics: Callable[[MetricSample], None] | None = None,
                 on_tokens: Callable[[str, int, int], None] | None = None):
        self.ledger = RequestLedger(on_result, on_refused)
        self._on_metrics = on_metrics
        self._on_tokens = on_tokens
        self._lock = threading.RLock()
        self._lanes: dict[str, Lane] = {}
        self._active: Lane | None = None
        self.fallback: Lane | None = None
        self._holding = False
        self._parked: list[str] = []
        self.failures: list[tuple[str, str]] = []
        self._seq = itertools.count(1)
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._poll_refusals, name="flexpipe-router-monitor", daemon=True)
        self._monitor.start()

    # -- lanes --------------------------------------------------------------------------------------
    def add_lane(self, runtime: PipelineRuntime, state: LaneState = "warming") -> Lane:
        """Wrap a *started* runtime in a lane (not the entry point) and start its pump."""
        lane = Lane(f"{runtime.gear.gear_id}#{next(self._seq)}", runtime, self)
        lane.state = state
        with self._lock:
            self._lanes[lane.lane_id] = lane
        lane.start_pump()
        return lane

    def open(self, runtime: PipelineRuntime) -> Lane:
        """Start ``runtime`` if needed and make it the entry point; held requests go to it.

        Raises: whatever ``runtime.start()`` raises (InputError, InfeasibleError, StageFailedError).
        """
        if not runtime.stage_info:
            runtime.start()
        lane = self.add_lane(runtime, state="active")
        with self._lock:
            old = self._active
            self._active = lane
            if old is not None and old.alive and old is not lane:
                old.state = "draining"
            self._holding = False
            self._flush_held()
            self._flush_parked()
        return lane

    @property
    def active(self) -> Lane | None:
        """The entry-point lane (``None`` before :meth:`open`)."""
        return self._active

    @property
    def lanes(self) -> list[Lane]:
        with self._lock:
            return list(self._lanes.values())

    def switch_to(self, lane: Lane) -> Lane | None:
        """Atomically make ``lane`` the entry point; the previous one starts draining (its requests
        finish there). Held requests go to ``lane`` unless the router is holding. Returns the old lane."""
        with self._lock:
            if not lane.alive:
                raise InputError(None, "lane", f"lane {lane.lane_id} is {lane.state}; cannot switch to it")
            old, self._active = self._active, lane
            lane.state = "active"
            if old is not None and old is not lane and old.alive:
                old.state = "draining"
            if not self._holding:
                self._flush_held()
            return old

    # -- admission ----------------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> list[str]:
        """Accept requests (online and offline alike) and send them to the entry point, or hold them.

        Raises:
            InputError: a request id was submitted before, or uses the executor's reserved prefix.
        """
        reqs = list(requests)
        with self._lock:
            lane = self._target()
            entries = [self.ledger.accept(r, lane.lane_id if lane else None) for r in reqs]
            if lane is not None:
                lane.runtime.submit([e.request for e in entries])
        return [r.request_id for r in reqs]

    def probe_id(self, kind: str) -> str:
        """A fresh id for an internal request (unique within this router)."""
        return f"{INTERNAL_PREFIX}{kind}-{next(self._seq)}"

    def submit_probe(self, lane: Lane, request: Request) -> Probe:
        """Send an internal (executor) request straight to ``lane``; its output goes to the probe."""
        entry = self.ledger.accept(request, lane.lane_id, internal=True)
        if lane.alive:
            lane.runtime.submit([request])
        else:
            self.ledger.fail_internal(lane.lane_id, f"lane {lane.lane_id} is {lane.state}")
        assert entry.probe is not None  # accept(internal=True) always gives the entry a probe
        return entry.probe

    def _target(self) -> Lane | None:
        a = self._active
        return None if self._holding or a is None or not a.alive else a

    def hold(self) -> None:
        """Close the entry point: new requests wait in the router until :meth:`release_held`."""
        with self._lock:
            self._holding = True

    def release_held(self) -> int:
        """Open the entry point again; send every held request to it. Returns how many went."""
        with self._lock:
            self._holding = False
            return self._flush_held()

    def _flush_held(self) -> int:
        lane = self._target()
        if lane is None:
            return 0
        held = self.ledger.open_on(None)
        return self._send(held, lane) if held else 0

    def _send(self, entries: list[LedgerEntry], lane: Lane) -> int:
        for e in entries:
            self.ledger.assign(e.request.request_id, lane.lane_id)
        lane.runtime.submit([e.request for e in entries])
        return len(entries)

    def move_open(self, src: Lane, dst: Lane | None = None) -> int:
        """Re-submit every caller request open on ``src`` to ``dst`` (default: the entry point, or
        held if there is none). Only for a lane that will not finish them (failed or killed)."""
        with self._lock:
            entries = self.ledger.open_on(src.lane_id)
            if not entries:
                return 0
            dst = dst if dst is not None and dst.alive else self._target()
            if dst is None or dst is src:
                for e in entries:
                    self.ledger.hold(e.request.request_id)
                return len(entries)
            return self._send(entries, dst)

    def resubmit_parked(self) -> int:
        """Send requests parked after a refusal (degraded KV pool, failed health check) to the entry point."""
        with self._lock:
            return self._flush_parked()

    def _flush_parked(self) -> int:
        lane = self._target()
        if lane is None or not self._parked:
            return 0
        entries = [self.ledger.get(rid) for rid in self._parked]
        self._parked = []
        return self._send([e for e in entries if e.status in ("held", "pending")], lane)

    @property
    def parked(self) -> list[str]:
        with self._lock:
            return list(self._parked)

    # -- waiting / closing --------------------------------------------------------------------------
    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every caller request finished or was refused; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.ledger.num_open():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every lane (graceful shutdown; requests still queued in a runtime are dropped)."""
        self._closed.set()
        for lane in self.lanes:
            if lane.alive:
                lane.retire(timeout_s)

    def __enter__(self) -> ServingRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reports from lanes (LaneOwner; pump / monitor threads) -------------------------------------
    def lane_metrics(self, lane: Lane, sample: Any) -> None:
        """Pass a lane's metric sample to ``on_metrics``."""
        if self._on_metrics is not None:
            self._on_metrics(sample)

    def lane_tokens(self, lane: Lane, tokens: tuple[tuple[str, int, int], ...]) -> None:
        """Pass a lane's sampled tokens of caller requests (not the executor's probes) to ``on_tokens``."""
        if self._on_tokens is not None:
            for request_id, index, token_id in tokens:
                if not request_id.startswith(INTERNAL_PREFIX):
                    self._on_tokens(request_id, index, token_id)

    def lane_failed(self, lane: Lane, err: BaseException) -> None:
        """Keep the failed lane's delivered outputs, fail its probes, mark it failed, fall back if it was
        the entry point, and re-submit (or hold) its open requests."""
        for out in getattr(err, "finished", []) or []:  # delivered ones are dropped as duplicates
            self.ledger.finish(out, lane.lane_id)
        reason = f"{type(err).__name__}: {err}"
        self.ledger.fail_internal(lane.lane_id, reason)
        with self._lock:
            lane.state = "failed"
            if not lane.forced:
                self.failures.append((lane.lane_id, reason))
            if lane is self._active:
                fb = self.fallback
                if fb is not None and fb.alive and fb is not lane:
                    self._active, fb.state = fb, "active"
                self.fallback = None
            if self.fallback is lane:
                self.fallback = None
            self.move_open(lane)

    def lane_refused(self, lane: Lane, refusals: dict[str, str]) -> None:
        """Refuse each request for good (policy ``final``, probes) or park it for a later re-submission
        (policies ``park`` / ``fail``; ``fail`` also records the lane's health failure)."""
        for rid, reason in refusals.items():
            try:
                entry = self.ledger.get(rid)
            except KeyError:
                continue
            if entry.internal or lane.refusal_policy == "final" or entry.lane_id != lane.lane_id:
                if entry.lane_id == lane.lane_id:
                    self.ledger.refuse(rid, reason)
                continue
            with self._lock:
                self.ledger.hold(rid)
                self._parked.append(rid)
                if lane.refusal_policy == "fail" and lane.health_failure is None:
                    lane.health_failure = f"request {rid} refused: {reason}"

    def lane_gone(self, lane: Lane) -> None:
        """A lane was retired or killed: anything still open on it moves on."""
        self.ledger.fail_internal(lane.lane_id, f"lane {lane.lane_id} stopped")
        with self._lock:
            if self.fallback is lane:
                self.fallback = None
            if self._active is lane:
                self._active = None
            self.move_open(lane)

    def _poll_refusals(self) -> None:
        while not self._closed.wait(REFUSAL_POLL_S):
            for lane in self.lanes:
                if lane.alive:
                    try:
                        lane.poll_refusals()
                    except Exception:
                        pass
