"""The store side of a live pipeline: its heartbeat, its metric samples, and the gear shifts asked of it.

:class:`LiveControl` is what makes a serving process (the ``serve_trace`` loop, the ``flexpipe serve``
front door) a *serving run* of the store. Every control step it writes the pipeline's metric samples
(``t_s`` rebased to seconds since it started, so samples of successive gears form one series) and a
heartbeat, takes a shift that a ``gear_shift`` run requested for this run, and only this run (a
compare-and-set, ``applying``), or with inline control asks the controller through the same service
the ``gear_shift_sensor`` calls (:func:`flexpipe_dag.control.service.evaluate_gear_shift`). A shift
runs in a background thread on the :class:`~flexpipe_dag.shift.executor.GearExecutor` while traffic
keeps flowing; its outcome is stored with the event (a rolled-back gear is tagged unhealthy). A
request that no longer fits (its target already serves, or it was decided on another gear) is failed,
never applied.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from flexpipe_dag.control.service import evaluate_gear_shift
from flexpipe_dag.control.settings import ResolvedControlSettings
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.core.status import PipelineRunKind, ShiftEventStatus


class LiveControl:
    """Registers a live pipeline in the store and applies the shifts asked of it; see module docstring.

    Args:
        store: the SQL store (samples, heartbeats, shift events, health tags).
        control: the resolved controller figures.
        router: the :class:`~flexpipe_dag.shift.router.ServingRouter` (its ``active`` lane is the live gear).
        executor: the :class:`~flexpipe_dag.shift.executor.GearExecutor` on ``router``.
        gears: gears a shift may go to, by id (others are looked up in the store).
        run_key: this serving run's key in the store.
        inline_control: decide shifts here (True) or only apply ``gear_shift`` runs' requests (False:
            the ``gear_shift_sensor`` decides).
        forecast: ``() -> ForecastFn | None``, the tide forecast the controller may use (inline only).
        log: called with one line per event worth telling the user.
        on_shift_done: called with a shift's record once it has its final ``status`` (done,
            rolled_back, failed), from the shift's thread.
        shifts_refused: why this run takes no gear shift (each one asked of it is failed with this reason),
            or None.
        keep_history: keep every sample and declined decision in :attr:`samples` / :attr:`declines` too (a
            bounded run's report reads them); False for a server that runs for days (the store has them).

    Attributes:
        samples, shifts, declines: what was stored, shifted (each a dict with ``status`` and
            ``outcome``) and declined, oldest first (samples and declines only with ``keep_history``).
        t0: the monotonic time sample ``t_s`` counts from.
        endpoint: the base URL clients reach this run at, stored with each heartbeat once set (None: no API).
    """

    def __init__(self, store, control: ResolvedControlSettings, router, executor, gears: Sequence[Gear],
                 run_key: str, *, inline_control: bool = True, forecast: Callable[[], Any] | None = None,
                 log: Callable[[str], None] = print, on_shift_done: Callable[[dict[str, Any]], None] | None = None,
                 shifts_refused: str | None = None, keep_history: bool = True):
        self.db, self.control, self.router, self.executor = store, control, router, executor
        self.gears = {g.gear_id: g for g in gears}
        self.run_key, self.inline_control, self.forecast, self.log = run_key, inline_control, forecast, log
        self.on_shift_done = on_shift_done
        self.shifts_refused = shifts_refused
        self.keep_history = keep_history
        self.samples: list[MetricSample] = []
        self.shifts: list[dict[str, Any]] = []
        self.declines: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.endpoint: str | None = None
        self.shift_thread: threading.Thread | None = None
        self._samples: queue.Queue = queue.Queue()
        self._last_t_s: float | None = None  # the newest t_s stored
        self._cursor: str | None = None
        self._declined_logged: dict[str | None, float] = {}

    def on_metrics(self, sample: MetricSample) -> None:
        """A sample of the live pipeline (router callback: any thread)."""
        self._samples.put((time.monotonic() - self.t0, sample))

    def heartbeat(self) -> None:
        """Tell the store this run is live, and on which gear."""
        active = getattr(self.router, "active", None)
        self.db.heartbeat_pipeline_run(self.run_key, PipelineRunKind.SERVE,
                                       active.gear.gear_id if active is not None else None,
                                       inline_control=self.inline_control, endpoint=self.endpoint)

    def end(self) -> None:
        """Mark the run ended (its samples never trigger a shift again)."""
        self.db.end_pipeline_run(self.run_key)

    @property
    def idle(self) -> bool:
        """No shift is under way."""
        return self.shift_thread is None or not self.shift_thread.is_alive()

    def write_samples(self) -> None:
        """Store the samples received since the last call (``t_s`` rebased to seconds since :attr:`t0`, when
        each was received: the lanes' runtimes each count from their own start).

        The stored ``t_s`` rise strictly, 1 ms apart at least: samples handed on together (a pump delivering
        a backlog, two lanes in the same millisecond) would otherwise share a ``t_s``, and the controller,
        which reads a sample not after the last one it read as already read, would drop all but one."""
        batch = []
        while True:
            try:
                wall_s, smp = self._samples.get_nowait()
            except queue.Empty:
                break
            batch.append(dataclasses.replace(smp, t_s=round(wall_s, 3)))
        if batch:
            batch.sort(key=lambda x: x.t_s)
            for i, smp in enumerate(batch):
                if self._last_t_s is not None and smp.t_s <= self._last_t_s:
                    batch[i] = smp = dataclasses.replace(smp, t_s=round(self._last_t_s + 0.001, 3))
                self._last_t_s = smp.t_s
            self.db.write_samples(self.run_key, batch)
            if self.keep_history:
                self.samples.extend(batch)

    # -- gear shifting --------------------------------------------------------------------------------
    def step(self) -> None:
        """One control step: heartbeat, then take a shift request addressed to this run (or, with inline
        control, ask the controller); a shift runs in a background thread while traffic flows."""
        self.heartbeat()
        if not self.idle:
            return
        # asked for by gear_shift runs (sensor mode / by hand), addressed to this run only
        for ev in self.db.pending_shift_requests(self.run_key):
            if self.db.claim_shift_request(ev.id, self.run_key):
                self._start_shift(ev.id, ev.from_gear_key, ev.to_gear_key, ev.trigger or "manual", ev.reason)
                return
        if not self.inline_control:
            return
        forecast = self.forecast() if self.forecast is not None else None
        ev = evaluate_gear_shift(self.db, self._cursor, self.control, run_key_prefix=f"{self.run_key}:",
                                 run_key=self.run_key, forecast=forecast)
        self._cursor = ev.cursor
        d = ev.decision
        now = time.monotonic()
        if d is not None and d.declined and self.keep_history:
            self.declines.append({"t_s": round(d.t_s, 1), "from_gear": d.from_gear_id, "to_gear": d.to_gear_id,
                                         "trigger": d.trigger, "kind": d.reason_kind, "reason": d.reason})
        if d is not None and d.declined and now - self._declined_logged.get(d.trigger, -1e9) >= 30.0:
            self._declined_logged[d.trigger] = now  # every decision is stored; the log shows one per 30 s
            self.log(f"controller: {d.reason}")
        if ev.run_key is not None:
            # a run key comes only with a stored shift decision, which names its target and trigger
            assert d is not None and ev.event_id is not None and d.to_gear_id is not None and d.trigger is not None
            if self.db.claim_shift_request(ev.event_id, self.run_key, {"run_key": ev.run_key}):
                self._start_shift(ev.event_id, d.from_gear_id, d.to_gear_id, d.trigger, d.reason)

    def _stale_request(self, from_gear: str | None, to_gear: str) -> str | None:
        """Why a shift request no longer fits the pipeline (one line), or None: its target already serves (a second
        decision on the same load, e.g. one the sensor took while this loop took its own) or it was decided on
        another gear than the one serving now. Never re-runs a migration to the gear already serving."""
        active = getattr(self.router, "active", None)
        serving = active.gear.gear_id if active is not None else None
        if serving is None:
            return None
        if to_gear == serving:
            return f"stale: {serving} is already serving"
        if from_gear is not None and from_gear != serving:
            return f"stale: decided on {from_gear}, but {serving} is serving now"
        return None

    def _start_shift(self, event_id: int, from_gear: str | None, to_gear: str, trigger: str, reason: str) -> None:
        gear = self.gears.get(to_gear) or self.db.load_gear(to_gear)
        t_s = round(time.monotonic() - self.t0, 1)
        record = {"t_s": t_s, "from_gear": from_gear, "to_gear": to_gear, "trigger": trigger, "reason": reason,
                  "status": "running", "event_id": event_id}
        self.shifts.append(record)
        stale = self.shifts_refused or self._stale_request(from_gear, to_gear)
        if gear is None or stale is not None:
            error = stale or f"unknown gear {to_gear}"
            record.update(status="failed", outcome=error)
            self.db.update_shift_event(event_id, ShiftEventStatus.FAILED, {"error": error, "outcome": error})
            self.log(f"shift event {event_id} ({from_gear} -> {to_gear}) refused: {error}")
            if self.on_shift_done is not None:
                self.on_shift_done(record)
            return
        self.log(f"t={t_s:.0f}s shift {from_gear} -> {to_gear} ({trigger}): {reason}")

        def run() -> None:
            outcome = self.executor.shift(gear)
            record.update(status=outcome.status, outcome=outcome.reason, timings_s=outcome.timings_s,
                          mode=outcome.mode, requests_moved=outcome.requests_moved)
            details = {**outcome.to_details(), "outcome": outcome.reason}
            self.db.update_shift_event(event_id, outcome.status, details)
            if outcome.unhealthy_gear_id:
                self.db.mark_unhealthy(outcome.unhealthy_gear_id, gear.cluster_id or "local", gear.model_name,
                                       outcome.failure_kind or "health_check", outcome.reason,
                                       run_key=self.run_key)
            self.log(f"shift to {to_gear}: {outcome.status} in {outcome.timings_s.get('total', 0):.1f}s "
                     f"({outcome.mode}): {outcome.reason}")
            if self.on_shift_done is not None:
                self.on_shift_done(record)

        self.shift_thread = threading.Thread(target=run, name="flexpipe-shift", daemon=True)
        self.shift_thread.start()

