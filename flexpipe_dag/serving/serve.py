"""The serve loop: replay a real trace through the live pipeline, shift gears as the load changes, fill troughs.

:class:`TraceServer` owns a :class:`~flexpipe_dag.shift.router.ServingRouter` (the entry point) and a
:class:`~flexpipe_dag.shift.executor.GearExecutor`. Every ``control_interval_s`` it:

* writes the pipeline's metric samples to the store (``t_s`` rebased to seconds since the serve
  started, so samples of successive gears form one series) and a heartbeat (the run is live until it
  ends: :meth:`TraceServer.serve` marks it ended however it stops);
* asks the controller through the *same* service the ``gear_shift_sensor`` calls
  (:func:`flexpipe_dag.control.service.evaluate_gear_shift`) when ``inline_control`` is on, and applies shifts
  that ``gear_shift`` runs requested through the store (status ``requested``) of this run, and only
  those, in any case (taking each with a compare-and-set, ``applying``); a shift
  runs in a background thread while traffic keeps flowing, and its outcome is stored with the event
  (a rolled-back gear is tagged unhealthy);
* decides offline admission with the tide rule (:func:`flexpipe_dag.control.tide.decide_offline`)
  and feeds the offline job's requests (offline priority, a bounded number in flight) only while
  admitted.

Every finished request is written to the store as it finishes (idempotent per id). Nothing is lost:
the router delivers each request's output exactly once, across shifts and rollbacks.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexpipe_dag.control.service import evaluate_gear_shift
from flexpipe_dag.control.settings import ResolvedControlSettings
from flexpipe_dag.control.tide import TideConfig, TideForecaster, TideGate, decide_offline, ema, tide_forecast
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.core.status import InferenceJobKind, InferenceJobStatus, PipelineRunKind, ShiftEventStatus
from flexpipe_dag.serving.prompts import TimedRequest


@dataclass
class ServeSettings:
    """How one serve run behaves (seconds unless named otherwise)."""

    run_key: str
    online_job_key: str
    offline_job_key: str | None = None
    control_interval_s: float = 2.0
    inline_control: bool = True
    tide_start_s: float = 0.0  # tide time of day at the start of the replay
    tide_compression: float = 1.0  # tide seconds per wall second
    max_offline_inflight: int = 4
    offline_grace_s: float = 120.0  # after the online trace ends, keep filling the trough this long at most
    drain_timeout_s: float = 300.0


@dataclass
class ServeReport:
    """What a serve run did: results per request, samples, shifts, declined shifts, offline admission decisions.

    ``declines``: every declined decision of the loop's controller (``t_s``, ``from_gear``, ``to_gear``,
    ``trigger``, ``kind`` = ``Decision.reason_kind``, ``reason``), as :func:`~flexpipe_dag.serving.report.summarize`
    reads them.
    """

    results: list[dict[str, Any]] = field(default_factory=list)
    samples: list[MetricSample] = field(default_factory=list)
    shifts: list[dict[str, Any]] = field(default_factory=list)
    declines: list[dict[str, Any]] = field(default_factory=list)
    tide_decisions: list[dict[str, Any]] = field(default_factory=list)
    submitted_online: int = 0
    submitted_offline: int = 0
    elapsed_s: float = 0.0


class TraceServer:
    """Serve ``online`` (and, in troughs, ``offline``) requests through the live pipeline; see module docstring.

    Args:
        store: the SQL store (samples, results, shift events, health tags).
        control: the resolved controller and tide figures
            (:class:`~flexpipe_dag.control.settings.ResolvedControlSettings`).
        router / executor: the serving front with its first gear open, and the shift executor on it.
        gears: gears the controller may choose from (by id).
        tokenizer: decodes outputs into text for the stored results (optional).
        forecaster: the tide history's forecaster (offline admission).
        log: called with one line per event worth telling the user.
    """

    def __init__(self, store, control: ResolvedControlSettings, router, executor, gears: Sequence[Gear], settings: ServeSettings, *,
                 forecaster: TideForecaster | None = None, tokenizer=None, log: Callable[[str], None] = print):
        self.db = store
        self.control = control
        self.router = router
        self.executor = executor
        self.gears = {g.gear_id: g for g in gears}
        self.settings = settings
        self.forecaster = forecaster
        self.tokenizer = tokenizer
        self.log = log
        self.report = ServeReport()
        self._outputs: queue.Queue = queue.Queue()
        self._samples: queue.Queue = queue.Queue()
        self._shift_thread: threading.Thread | None = None
        self._cursor: str | None = None
        self._declined_logged: dict[str | None, float] = {}
        self._ema_rps: float | None = None
        self._gate = TideGate()
        self._done_by_class: dict[str, int] = {}
        self._online_at_last_tide = 0
        self._klass: dict[str, str] = {}
        self._t0 = time.monotonic()
        self._sample_offset_s: dict[str, float] = {}

    # -- callbacks wired into the router (called from its threads) ------------------------------------
    def on_result(self, output) -> None:
        self._outputs.put(output)

    def on_metrics(self, sample: MetricSample) -> None:
        self._samples.put((time.monotonic() - self._t0, sample))

    # -- the loop -------------------------------------------------------------------------------------
    def serve(self, online: Sequence[TimedRequest], offline: Sequence[TimedRequest] = ()) -> ServeReport:
        """Replay ``online`` at its arrival times; feed ``offline`` in troughs; return the report.

        The run is registered live in the store while it serves (a heartbeat every control step) and
        marked ended when it stops, however it stops: its samples never trigger a shift afterwards.
        """
        self._heartbeat()
        try:
            return self._serve(online, offline)
        finally:
            self.db.end_pipeline_run(self.settings.run_key)

    def _heartbeat(self) -> None:
        active = getattr(self.router, "active", None)
        self.db.heartbeat_pipeline_run(self.settings.run_key, PipelineRunKind.SERVE,
                                       active.gear.gear_id if active is not None else None,
                                       inline_control=self.settings.inline_control)

    def _serve(self, online: Sequence[TimedRequest], offline: Sequence[TimedRequest]) -> ServeReport:
        s, db = self.settings, self.db
        self._t0 = time.monotonic()
        online_job = db.get_or_create_job(s.online_job_key, InferenceJobKind.ONLINE, source_path=s.run_key)
        offline_job = (db.get_or_create_job(s.offline_job_key, InferenceJobKind.BATCH, priority=-1)
                       if s.offline_job_key else None)
        db.update_job(online_job, status=InferenceJobStatus.RUNNING, total_requests=len(online))
        if offline_job is not None:
            db.update_job(offline_job, status=InferenceJobStatus.QUEUED, total_requests=len(offline))
        self._jobs = {"online": online_job, "offline": offline_job}
        pending = sorted(online, key=lambda r: r.arrival_s)
        offline_todo = [r for r in offline if r.request.request_id not in (db.done_request_keys(offline_job) if offline_job else set())]
        for r in list(online) + list(offline):
            self._klass[r.request.request_id] = r.klass
        next_control = self._t0 + s.control_interval_s
        i = 0
        online_end_s: float | None = None
        while True:
            now = time.monotonic() - self._t0
            due = []
            while i < len(pending) and pending[i].arrival_s <= now:
                due.append(pending[i].request)
                i += 1
            if due:
                self.router.submit(due)
                self.report.submitted_online += len(due)
            self._drain_outputs()
            if time.monotonic() >= next_control:
                next_control += s.control_interval_s
                self._write_samples()
                self._control_step()
                self._tide_step(now)
            if self._gate.running and offline_todo:
                inflight = self.report.submitted_offline - self._finished("offline")
                room = s.max_offline_inflight - inflight
                if room > 0:
                    batch, offline_todo = offline_todo[:room], offline_todo[room:]
                    self.router.submit([r.request for r in batch])
                    self.report.submitted_offline += len(batch)
                    if offline_job is not None:
                        db.update_job(offline_job, status=InferenceJobStatus.RUNNING)
            online_done = i == len(pending) and self._finished("online") == len(pending)
            if online_done:
                if online_end_s is None:
                    online_end_s = now
                offline_settled = not offline_todo and self._finished("offline") == self.report.submitted_offline
                if (offline_settled or now - online_end_s > s.offline_grace_s) and self._idle_shift():
                    break
            time.sleep(0.05)
        self._finish_offline(offline_todo)
        self._write_samples()
        db.update_job(online_job, status=InferenceJobStatus.DONE)
        self.report.elapsed_s = time.monotonic() - self._t0
        return self.report

    def _finish_offline(self, offline_todo) -> None:
        """Wait for submitted offline requests to finish; what was never admitted stays queued (paused)."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._finished("offline") < self.report.submitted_offline and time.monotonic() < deadline:
            self._drain_outputs()
            time.sleep(0.05)
        self._drain_outputs()
        job = self._jobs["offline"]
        if job is not None:
            self.db.update_job(job, status=InferenceJobStatus.PAUSED if offline_todo else InferenceJobStatus.DONE)

    def _finished(self, klass: str) -> int:
        return self._done_by_class.get(klass, 0)

    def _idle_shift(self) -> bool:
        return self._shift_thread is None or not self._shift_thread.is_alive()

    # -- results and samples --------------------------------------------------------------------------
    def _drain_outputs(self) -> None:
        from flexpipe_dag.runtime.batch import result_record

        while True:
            try:
                out = self._outputs.get_nowait()
            except queue.Empty:
                return
            rec = result_record(out, self.router.active.gear.gear_id if self.router.active else "", self.tokenizer)
            rec["klass"] = self._klass.get(out.request_id, "online")
            self.report.results.append(rec)
            self._done_by_class[rec["klass"]] = self._done_by_class.get(rec["klass"], 0) + 1
            job = self._jobs[rec["klass"]]
            if job is not None:
                self.db.write_result(job, rec["id"], prompt_tokens=rec["prompt_tokens"],
                                     output_token_ids=rec["output_token_ids"], gear_key=rec["gear_id"],
                                     output_text=rec.get("output_text"), ttft_ms=rec["ttft_ms"],
                                     tpot_ms=rec["tpot_ms"], e2e_ms=rec["e2e_ms"])

    def _write_samples(self) -> None:
        batch = []
        while True:
            try:
                wall_s, smp = self._samples.get_nowait()
            except queue.Empty:
                break
            batch.append(dataclasses.replace(smp, t_s=round(wall_s, 3)))
        if batch:
            batch.sort(key=lambda x: x.t_s)
            self.db.write_samples(self.settings.run_key, batch)
            self.report.samples.extend(batch)

    # -- gear shifting --------------------------------------------------------------------------------
    def _control_step(self) -> None:
        self._heartbeat()
        if not self._idle_shift():
            return
        # asked for by gear_shift runs (sensor mode / by hand), addressed to this run only
        for ev in self.db.pending_shift_requests(self.settings.run_key):
            if self.db.claim_shift_request(ev.id, self.settings.run_key):
                self._start_shift(ev.id, ev.from_gear_key, ev.to_gear_key, ev.trigger or "manual", ev.reason)
                return
        if not self.settings.inline_control:
            return
        forecast = None
        if self.forecaster is not None:  # samples' t_s and tide time share this loop's clock
            forecast = tide_forecast(self.forecaster,
                                     lambda t_s: self.settings.tide_start_s + self.settings.tide_compression * t_s,
                                     self.settings.tide_compression)
        ev = evaluate_gear_shift(self.db, self._cursor, self.control, run_key_prefix=f"{self.settings.run_key}:",
                                 run_key=self.settings.run_key, forecast=forecast)
        self._cursor = ev.cursor
        d = ev.decision
        now = time.monotonic()
        if d is not None and d.declined:
            self.report.declines.append({"t_s": round(d.t_s, 1), "from_gear": d.from_gear_id, "to_gear": d.to_gear_id,
                                         "trigger": d.trigger, "kind": d.reason_kind, "reason": d.reason})
        if d is not None and d.declined and now - self._declined_logged.get(d.trigger, -1e9) >= 30.0:
            self._declined_logged[d.trigger] = now  # every decision is stored; the log shows one per 30 s
            self.log(f"controller: {d.reason}")
        if ev.run_key is not None:
            # a run key comes only with a stored shift decision, which names its target and trigger
            assert d is not None and ev.event_id is not None and d.to_gear_id is not None and d.trigger is not None
            if self.db.claim_shift_request(ev.event_id, self.settings.run_key, {"run_key": ev.run_key}):
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
        t_s = round(time.monotonic() - self._t0, 1)
        record = {"t_s": t_s, "from_gear": from_gear, "to_gear": to_gear, "trigger": trigger, "reason": reason,
                  "status": "running", "event_id": event_id}
        self.report.shifts.append(record)
        stale = self._stale_request(from_gear, to_gear)
        if gear is None or stale is not None:
            error = stale or f"unknown gear {to_gear}"
            record.update(status="failed", outcome=error)
            self.db.update_shift_event(event_id, ShiftEventStatus.FAILED, {"error": error, "outcome": error})
            self.log(f"shift event {event_id} ({from_gear} -> {to_gear}) refused: {error}")
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
                                       run_key=self.settings.run_key)
            self.log(f"shift to {to_gear}: {outcome.status} in {outcome.timings_s.get('total', 0):.1f}s "
                     f"({outcome.mode}): {outcome.reason}")

        self._shift_thread = threading.Thread(target=run, name="flexpipe-shift", daemon=True)
        self._shift_thread.start()

    # -- offline admission ----------------------------------------------------------------------------
    def _tide_step(self, now_s: float) -> None:
        if self.forecaster is None or self._jobs.get("offline") is None:
            return
        cfg: TideConfig = self.control.tide
        # offered online load over the last interval, from the arrivals this loop submitted (it keeps
        # falling to 0 when the trace goes quiet, when an idle pipeline reports no samples)
        interval = self.settings.control_interval_s
        arrived = self.report.submitted_online - self._online_at_last_tide
        self._online_at_last_tide = self.report.submitted_online
        self._ema_rps = ema(self._ema_rps, arrived / interval, cfg.ema_alpha)
        active = self.router.active
        capacity = active.gear.rps_max if active is not None else float("inf")
        tide_time = self.settings.tide_start_s + self.settings.tide_compression * now_s
        d = decide_offline(self.forecaster, cfg, tide_time_s=tide_time, ema_rps=self._ema_rps,
                           capacity_rps=capacity, offline_running=self._gate.running)
        self._gate, act = self._gate.step(d, cfg.hysteresis_samples)
        if act is None:
            return
        self.report.tide_decisions.append({"t_s": round(now_s, 1), "action": act.action, "reason": act.reason})
        self.db.update_job(self._jobs["offline"],
                           status=InferenceJobStatus.RUNNING if self._gate.running else InferenceJobStatus.PAUSED)
        self.log(f"t={now_s:.0f}s tide: {d.reason}")
