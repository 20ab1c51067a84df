"""The serve loop: replay a real trace through the live pipeline, shift gears as the load changes, fill troughs.

:class:`TraceServer` owns a :class:`~flexpipe_dag.shift.router.ServingRouter` (the entry point), a
:class:`~flexpipe_dag.shift.executor.GearExecutor` and a :class:`~flexpipe_dag.serving.live_control.LiveControl`
(the store side it shares with the ``flexpipe serve`` front door). Every ``control_interval_s`` it:

* writes the pipeline's metric samples and a heartbeat to the store, and applies the shifts asked of
  this run (or, with ``inline_control``, decides them through the same service the
  ``gear_shift_sensor`` calls), through its :class:`LiveControl`;
* decides offline admission with the tide rule (:func:`flexpipe_dag.control.tide.decide_offline`)
  and feeds the offline job's requests (offline priority, a bounded number in flight) only while
  admitted.

Every finished request is written to the store as it finishes (idempotent per id). Nothing is lost:
the router delivers each request's output exactly once, across shifts and rollbacks.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexpipe_dag.control.settings import ResolvedControlSettings
from flexpipe_dag.control.tide import TideConfig, TideForecaster, TideGate, decide_offline, ema, tide_forecast
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.core.status import InferenceJobKind, InferenceJobStatus
from flexpipe_dag.serving.live_control import LiveControl
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
        self.live = LiveControl(store, control, router, executor, gears, settings.run_key,
                                inline_control=settings.inline_control, forecast=self._forecast, log=log)
        self.report = ServeReport(samples=self.live.samples, shifts=self.live.shifts, declines=self.live.declines)
        self._outputs: queue.Queue = queue.Queue()
        self._ema_rps: float | None = None
        self._gate = TideGate()
        self._done_by_class: dict[str, int] = {}
        self._online_at_last_tide = 0
        self._klass: dict[str, str] = {}
        self._t0 = time.monotonic()

    # -- callbacks wired into the router (called from its threads) ------------------------------------
    def on_result(self, output) -> None:
        self._outputs.put(output)

    def on_metrics(self, sample: MetricSample) -> None:
        self.live.on_metrics(sample)

    def _forecast(self):
        """The tide forecast of this replay's clock (samples' ``t_s`` and tide time share it), or None."""
        if self.forecaster is None:
            return None
        return tide_forecast(self.forecaster,
                             lambda t_s: self.settings.tide_start_s + self.settings.tide_compression * t_s,
                             self.settings.tide_compression)

    # the store side, shared with the front door (tests drive these directly)
    def _control_step(self) -> None:
        self.live.step()

    @property
    def _shift_thread(self) -> threading.Thread | None:
        return self.live.shift_thread

    # -- the loop -------------------------------------------------------------------------------------
    def serve(self, online: Sequence[TimedRequest], offline: Sequence[TimedRequest] = ()) -> ServeReport:
        """Replay ``online`` at its arrival times; feed ``offline`` in troughs; return the report.

        The run is registered live in the store while it serves (a heartbeat every control step) and
        marked ended when it stops, however it stops: its samples never trigger a shift afterwards.
        """
        self.live.heartbeat()
        try:
            return self._serve(online, offline)
        finally:
            self.live.end()

    def _serve(self, online: Sequence[TimedRequest], offline: Sequence[TimedRequest]) -> ServeReport:
        s, db = self.settings, self.db
        self._t0 = self.live.t0 = time.monotonic()
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
                self.live.write_samples()
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
                if (offline_settled or now - online_end_s > s.offline_grace_s) and self.live.idle:
                    break
            time.sleep(0.05)
        self._finish_offline(offline_todo)
        self.live.write_samples()
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
