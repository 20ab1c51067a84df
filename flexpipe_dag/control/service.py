"""The decision services: one gear-shift evaluation and one offline-admission (tide) evaluation against the store.

The live pipeline and the Dagster wiring meet in the SQL store. The pipeline writes metric samples;
:func:`evaluate_gear_shift` (called by the ``gear_shift_sensor`` and by the serve loop itself) reads the
new ones, asks the pure :class:`~flexpipe_dag.control.controller.Controller`, records every decision
taken or declined with its reason as a shift event (status ``decided`` / ``declined``) and returns the
deterministic run key of a shift. :func:`evaluate_tide` (called by the ``tide_sensor``) keeps the
smoothed online request rate in its cursor, decides offline admission with the tide rule
(:func:`flexpipe_dag.control.tide.decide_offline`), marks batch jobs ``admitted`` or ``paused`` and
returns the run keys of the admissions.

Both take the resolved figures (:class:`~flexpipe_dag.control.settings.ResolvedControlSettings`,
:class:`~flexpipe_dag.control.config.ControllerConfig`, :class:`~flexpipe_dag.control.tide.TideConfig`)
and the store through the protocols below (:class:`GearShiftStore`, :class:`TideStore`; the SQL
``Store`` satisfies both): no Dagster, no SQL import here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from flexpipe_dag.control.config import MIN_BUDGET_S
from flexpipe_dag.control.controller import Controller
from flexpipe_dag.control.cursor import (
    RunTide,
    TideCursor,
    decline_signature,
    make_cursor,
    make_fleet_shift_cursor,
    read_fleet_shift_cursor,
    read_gear_shift_cursor,
)
from flexpipe_dag.control.settings import ResolvedControlSettings
from flexpipe_dag.control.state import ControllerState, Decision, ReasonKind
from flexpipe_dag.control.tide import (
    TideConfig,
    TideDecision,
    TideForecaster,
    TideGate,
    decide_offline,
    ema,
    load_history,
    tide_forecast,
)
from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.errors import FlexPipeError, InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.liveness import PipelineLiveness
from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.core.status import API_BATCH_CONFIG_KEY, UNFINISHED_JOB_STATUSES

#: ``forecast(t_s, rps, horizon_s) -> req/s``, what :meth:`Controller.decide` takes as ``forecast``.
ForecastFn = Callable[[float, float, float], float]


# -- what the services need of the store ------------------------------------------------------------
class ProfileVersionRef(Protocol):
    """A stored cluster-profile version (only its row id is read)."""

    @property
    def id(self) -> int: ...


class BatchJobRow(Protocol):
    """A stored inference job as the tide reads it."""

    @property
    def id(self) -> int: ...

    @property
    def job_key(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def admissions(self) -> int: ...


@runtime_checkable
class GearShiftStore(Protocol):
    """The store methods :func:`evaluate_gear_shift` calls (the SQL ``Store`` has them)."""

    def latest_sample_run_key(self) -> str | None: ...

    def latest_shiftable_run_key(self) -> str | None: ...

    def recent_shiftable_run_keys(self) -> list[str]: ...

    def pipeline_liveness(self, run_key: str) -> PipelineLiveness: ...

    def read_samples(self, *, run_key: str | None = None, after_id: int | None = None,
                     limit: int | None = None, online_only: bool = False) -> list[tuple[int, MetricSample]]: ...

    def list_profile_versions(self) -> Sequence[ProfileVersionRef]: ...

    def load_gears(self, profile_version_id: int | None = None) -> list[Gear]: ...

    def load_gear(self, gear_key: str) -> Gear | None: ...

    def latest_profile(self) -> tuple[Any, ClusterProfile] | None: ...

    def unhealthy_gear_keys(self) -> set[str]: ...

    def record_shift_event(self, action: str, status: str, reason: str, *, from_gear_key: str | None = None,
                           to_gear_key: str | None = None, trigger: str | None = None,
                           est_gain: float | None = None, migration_cost_s: float | None = None,
                           run_key: str | None = None, details: dict[str, Any] | None = None,
                           decision_key: str | None = None) -> int: ...


@runtime_checkable
class TideStore(Protocol):
    """The store methods :func:`evaluate_tide` calls (the SQL ``Store`` has them)."""

    def read_run_samples(self, *, after_id: int | None = None, limit: int | None = None, online_only: bool = False,
                         written_after_s: float | None = None) -> list[tuple[int, str, MetricSample]]: ...

    def newest_sample_id(self) -> int | None: ...

    def pipeline_liveness(self, run_key: str) -> PipelineLiveness: ...

    def load_gear(self, gear_key: str) -> Gear | None: ...

    def jobs(self, *, kind: str | None = None, statuses: Iterable[str] | None = None) -> Sequence[BatchJobRow]: ...

    def update_job(self, job_id: int, **fields: Any) -> None: ...

    def transition_job(self, job_id: int, status: str, from_statuses: Iterable[str], **fields: Any) -> bool: ...


@runtime_checkable
class ControlStore(GearShiftStore, TideStore, Protocol):
    """Everything both services call."""


# -- gear shifting ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShiftEvaluation:
    """One evaluation: the decision (None when no new samples or no live run), the cursor to keep, the stored
    event and run key.

    ``event_id`` is set when the decision was stored (a shift or a declined one); ``run_key`` only
    for a shift. ``note`` says why there is no decision; ``samples_read`` counts the samples this
    evaluation consumed; ``backlog`` is True when it stopped before the newest sample (its time budget
    spent: the next evaluation goes on from the cursor).
    """

    decision: Decision | None
    cursor: str
    event_id: int | None = None
    run_key: str | None = None
    note: str | None = None
    samples_read: int = 0
    backlog: bool = False

    @property
    def summary(self) -> str:
        """The decision's reason, else why there is none ("no new metric samples" by default)."""
        return self.decision.reason if self.decision else self.note or "no new metric samples"


def shift_run_key(decision: Decision) -> str:
    """Deterministic run key: the same decision always maps to the same key (no duplicate runs).

    ``gear-shift:<from>-><to>@t<decision time, seconds on the samples' clock, 1 decimal>``.
    """
    return f"gear-shift:{decision.from_gear_id}->{decision.to_gear_id}@t{decision.t_s:.1f}"


def decision_key(decision: Decision, followed_run_key: str, run_key_prefix: str = "") -> str:
    """The stored decision's deterministic key (one decision, one event row, whatever the retries).

    A shift's is its run key: ``run_key_prefix`` + :func:`shift_run_key`, and without a prefix (the
    sensor) ``@<followed run>`` appended, since the samples' clock restarts with every serving run. A
    declined decision's is ``declined:<trigger>:<from>-><to>@t<t_s>`` made unique the same way.
    """
    if decision.action == "shift":
        base = shift_run_key(decision)
    else:
        base = f"declined:{decision.trigger}:{decision.from_gear_id}->{decision.to_gear_id or '-'}@t{decision.t_s:.1f}"
    return bounded_key(run_key_prefix + base if run_key_prefix else f"{base}@{followed_run_key}")


#: The longest key the store keeps (``shift_events.decision_key``, 200 characters).
MAX_KEY_CHARS = 200
#: Hex digits of the sha256 digest that ends a shortened key.
_DIGEST_CHARS = 16


def bounded_key(key: str, max_chars: int = MAX_KEY_CHARS) -> str:
    """``key`` itself when it holds at most ``max_chars`` characters, else a readable prefix, ``#`` and the first
    16 hex digits of its sha256 digest (``max_chars`` in all): deterministic, so a retried evaluation maps to the
    same stored row, and two long keys that share their prefix still differ (gear ids may be 200 characters)."""
    if len(key) <= max_chars:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:_DIGEST_CHARS]
    return f"{key[:max_chars - _DIGEST_CHARS - 1]}#{digest}"


def _migration_cost(db: GearShiftStore, gears: Sequence[Gear]) -> Callable[[Gear, Gear], float] | None:
    """The controller's migration-cost function (seconds) for the newest profile, or None when it cannot be built
    (no profile stored, no gears, or the gears' model is unknown)."""
    from flexpipe_dag.control.migration import migration_cost_fn
    from flexpipe_dag.planner.model_spec import load_model_spec

    latest = db.latest_profile()
    if latest is None or not gears:
        return None
    _, cluster = latest
    try:
        spec = load_model_spec(gears[0].model_name)
    except FlexPipeError:
        return None
    dtype = gears[0].dtype
    return migration_cost_fn(cluster, [spec.layer_weight_bytes(dtype)] * spec.num_layers,
                             embedding_bytes=spec.first_stage_extra_bytes(dtype),
                             lm_head_bytes=spec.last_stage_extra_bytes(dtype),
                             fallback_bandwidth_gbps=cluster.min_bandwidth_gbps() or 1.0)


def candidate_gears_for(db: GearShiftStore, serving_gear_ids: Iterable[str]) -> list[Gear]:
    """The newest profile's current gears, plus any gear the samples name that an earlier plan made."""
    latest = db.list_profile_versions()
    gears = db.load_gears(latest[-1].id) if latest else []
    known = {g.gear_id for g in gears}
    for gear_id in dict.fromkeys(serving_gear_ids):
        if gear_id not in known and (gear := db.load_gear(gear_id)) is not None:
            gears.append(gear)
            known.add(gear_id)
    return gears


def tide_time_s(epoch_s: float, compression: float) -> float:
    """Tide time (seconds since a tide midnight) for a wall-clock instant (epoch seconds); ``compression`` tide s
    per wall s."""
    return (epoch_s * compression) % 86400.0


def tide_history_forecast(tide: TideConfig, newest_t_s: float, epoch_s: float | None = None) -> ForecastFn:
    """The controller's load forecast from the tide history (``tide.history_file``, else the bundled
    ServeGen tide), on the metric samples' clock.

    A sample's ``t_s`` counts from its run's start, so it is placed in wall time by its distance to
    the newest sample (``newest_t_s``, taken as now: ``epoch_s``, epoch seconds, default the clock),
    then in tide time as the ``tide_sensor`` does (``tide.time_compression``).

    Raises:
        InputError: the history file is missing or not a tide (file and field named).
    """
    compression = tide.time_compression
    now = time.time() if epoch_s is None else epoch_s
    return tide_forecast(TideForecaster(load_history(tide)),
                         lambda t_s: tide_time_s(now - (newest_t_s - t_s), compression), compression)


def _hold(controller: Controller, state: ControllerState | None, reason: str, kind: ReasonKind) -> Decision:
    """A hold the service takes without asking the controller (``backlog``, ``not_live``), with its reason."""
    st = state or ControllerState()
    return Decision(t_s=st.last_sample_t_s or 0.0, action="hold", from_gear_id=st.gear_id, reason=reason,
                    reason_kind=kind, required_samples=controller.required_samples(st))


def evaluate_gear_shift(db: GearShiftStore, cursor: str | None, settings: ResolvedControlSettings,
                        run_key_prefix: str = "", run_key: str | None = None, forecast: ForecastFn | None = None,
                        epoch_s: float | None = None) -> ShiftEvaluation:
    """Read new samples, ask the controller, store the decision if a trigger fired; see module docstring.

    Bounded in time: samples are read ``controller.evaluation_page_samples`` at a time and folded into
    the controller's state (:meth:`Controller.observe`); after ``controller.evaluation_budget_s`` the
    evaluation stops, keeps its place (and the state) in the cursor and holds, saying how far it read.
    The decision is taken only on the page that reaches the newest sample, so a backlog read over
    several evaluations gives exactly the state and decision of one pass over it.

    A shift is taken only on a live serving run: the run followed must not have ended, be no batch job,
    and its newest sample (and heartbeat, when it sends them) must be younger than
    ``controller.sample_freshness_s``; otherwise the samples are still folded into the state and the
    decision is a hold that says why.

    Args:
        db: the store.
        cursor: what the previous evaluation returned (None / "" = start afresh).
        settings: the resolved controller and tide figures.
        run_key_prefix: put before the shift's run key (the serve loop prefixes its own run key).
        run_key: the serving run whose samples to follow (default: the newest sample's run among those
            not ended, not batch jobs and not deciding their own shifts; :func:`evaluate_gear_shifts` passes each
            such run in turn). When the
            followed run changes, the controller starts afresh (state and last sample read); so it does when
            the cursor's last sample id is past the run's newest (the store was reset), with a note saying so.
        forecast: the controller's load forecast; None with ``forecast_horizon_s`` > 0 in the
            controller settings uses :func:`tide_history_forecast`.
        epoch_s: now, epoch seconds (default the clock): the forecast's now and the freshness check's.

    Returns:
        The evaluation; a decision is stored (``record_shift_event`` with its :func:`decision_key`, status
        ``decided`` for a shift, ``declined`` for a declined one, addressed to the followed run) only when a
        trigger fired. A declined decision alike the last one stored for the run (:func:`decline_signature`)
        within ``controller.decline_repeat_s`` on the samples' clock is returned but not stored (``event_id``
        None, ``note`` says so): a trigger that keeps firing with nowhere to go leaves one row per that time.

    Raises:
        InputError: ``cursor`` is not one this service wrote; the tide history cannot be read.
    """
    state, last_id, followed, raised_by, last_decline = read_gear_shift_cursor(cursor)
    config = settings.controller
    controller = Controller(config)
    now_s = time.time() if epoch_s is None else epoch_s
    run_key = run_key or db.latest_shiftable_run_key()
    if run_key is None:
        return ShiftEvaluation(None, make_cursor(state, last_id, followed, raised_by, last_decline),
                               note=_why_nothing_followed(db, now_s, config.sample_freshness_s))
    if run_key != followed:  # another run: its samples, its clock, its decisions
        state, last_id, raised_by, last_decline = None, None, None, None
    live = db.pipeline_liveness(run_key)
    reset_note = None
    if last_id is not None and (live.newest_sample_id is None or last_id > live.newest_sample_id):
        reset_note = (f"the cursor's last_sample_id {last_id} is past run {run_key}'s newest sample "
                      f"({live.newest_sample_id}): the store was reset; reading the run afresh")
        state, last_id, raised_by, last_decline = None, None, None, None
    result = _evaluate_followed(db, controller, settings, state, last_id, run_key, raised_by, last_decline, live,
                                run_key_prefix, forecast, epoch_s, now_s)
    if reset_note is None:
        return result
    return dataclasses.replace(result, note=f"{reset_note}; {result.note}" if result.note else reset_note)


@dataclass(frozen=True)
class FleetShiftEvaluation:
    """One ``gear_shift_sensor`` evaluation over every serving run it follows: ``evaluations`` (run key -> that
    run's :class:`ShiftEvaluation`, newest writer first), the cursor to keep, and ``note`` (why no run is followed,
    when none is)."""

    evaluations: Mapping[str, ShiftEvaluation]
    cursor: str
    note: str | None = None
    #: one line per run whose samples could not be decided on (``run R: <the error>``): that run keeps its place
    #: in the cursor and is read again next time; the other runs are decided on all the same
    errors: tuple[str, ...] = ()

    @property
    def shifts(self) -> list[ShiftEvaluation]:
        """The evaluations that decided a shift (each with its run key), newest writer's first."""
        return [ev for ev in self.evaluations.values() if ev.run_key is not None]

    @property
    def summary(self) -> str:
        """One line: each followed run's decision or why there is none (``run R: ...``), or the note."""
        if not self.evaluations:
            return self.note or "no live serving run writes metric samples"
        if len(self.evaluations) == 1:
            return next(iter(self.evaluations.values())).summary
        return "; ".join(f"run {rk}: {ev.summary}" for rk, ev in self.evaluations.items())


def evaluate_gear_shifts(db: GearShiftStore, cursor: str | None, settings: ResolvedControlSettings,
                         epoch_s: float | None = None) -> FleetShiftEvaluation:
    """:func:`evaluate_gear_shift` on every serving run the ``gear_shift_sensor`` may follow, each on its own state.

    The runs are those that wrote the store's newest pipeline samples and are not ended, not batch jobs and do not
    decide their own shifts (``Store.recent_shiftable_run_keys``): several ``flexpipe serve`` processes may share
    one store, and each gets its own controller (smoothing, dwell, payback), its own decisions and its own
    ``gear_shift`` runs (a decision's key names the run it was taken on). The cursor keeps each followed run's
    cursor (:func:`~flexpipe_dag.control.cursor.read_fleet_shift_cursor`); a run that leaves the list leaves the
    cursor. The evaluation budget (``controller.evaluation_budget_s``) is shared: each run gets an equal part, at
    least ``MIN_BUDGET_S``. A run whose evaluation raises :class:`InputError` (e.g. its samples name a gear the store
    does not hold) is named in ``errors`` and keeps its place; the other runs are decided on all the same.

    Raises:
        InputError: ``cursor`` is not one this service wrote.
    """
    subs = read_fleet_shift_cursor(cursor)
    followed = db.recent_shiftable_run_keys()
    if not followed:
        now_s = time.time() if epoch_s is None else epoch_s
        return FleetShiftEvaluation({}, make_fleet_shift_cursor({}),
                                    _why_nothing_followed(db, now_s, settings.controller.sample_freshness_s))
    budget_s = max(MIN_BUDGET_S, settings.controller.evaluation_budget_s / len(followed))
    share = dataclasses.replace(settings, controller=settings.controller.model_copy(
        update={"evaluation_budget_s": budget_s}))
    evaluations: dict[str, ShiftEvaluation] = {}
    errors: list[str] = []
    for rk in followed:
        try:
            evaluations[rk] = evaluate_gear_shift(db, subs.get(rk), share, run_key=rk, epoch_s=epoch_s)
        except InputError as exc:  # this run's samples cannot be decided on; the others still are
            evaluations[rk] = ShiftEvaluation(None, subs.get(rk) or make_cursor(None, None, rk),
                                              note=f"not evaluated: {exc}")
            errors.append(f"run {rk}: {exc}")
    return FleetShiftEvaluation(evaluations, make_fleet_shift_cursor({rk: ev.cursor for rk, ev in evaluations.items()}),
                                errors=tuple(errors))


def _why_nothing_followed(db: GearShiftStore, now_s: float, freshness_s: float) -> str:
    """Why no serving run is followed: no samples, the newest sample's run is not live, or it decides its own
    shifts (a serve loop with inline control, which the sensor leaves alone: one decision, one shift)."""
    newest = db.latest_sample_run_key()
    if newest is None:
        return "no live serving run writes metric samples"
    live = db.pipeline_liveness(newest)
    why = live.why_not_live(now_s, freshness_s)
    if why is None and live.inline_control:
        return (f"no serving run for this sensor to follow: run {newest} decides its own shifts (a serve loop with "
                f"inline control), so the sensor leaves it alone")
    return "no live serving run writes metric samples" + (f" ({why})" if why else "")


def _evaluate_followed(db: GearShiftStore, controller: Controller, settings: ResolvedControlSettings,
                       state: ControllerState | None, last_id: int | None, run_key: str, raised_by: str | None,
                       last_decline: tuple[str, float] | None, live: PipelineLiveness, run_key_prefix: str,
                       forecast: ForecastFn | None, epoch_s: float | None, now_s: float) -> ShiftEvaluation:
    """:func:`evaluate_gear_shift` on the run it follows, from the cursor's fields (see there)."""
    config = settings.controller
    started_s = time.monotonic()
    read = 0
    unhealthy = db.unhealthy_gear_keys()
    gears: list[Gear] = []  # grows with the gears the pages name: the last page decides among all of them
    migration_cost: Callable[[Gear, Gear], float] | None = None
    while True:
        rows = db.read_samples(run_key=run_key, after_id=last_id, limit=config.evaluation_page_samples)
        if not rows:
            return ShiftEvaluation(None, make_cursor(state, last_id, run_key, raised_by, last_decline),
                                   samples_read=read)
        samples = [s for _, s in rows]
        read += len(rows)
        last_id = rows[-1][0]
        named = [g.gear_id for g in gears] + [smp.gear_id for smp in samples]
        if not gears or not set(named) <= {g.gear_id for g in gears}:  # the store is read once per new gear
            gears = candidate_gears_for(db, named)
            migration_cost = _migration_cost(db, gears)
        if forecast is None and config.forecast_horizon_s > 0:
            forecast = tide_history_forecast(settings.tide, max(live.newest_sample_t_s or samples[-1].t_s,
                                                                max(smp.t_s for smp in samples)), epoch_s)
        args: dict[str, Any] = dict(unhealthy=unhealthy, migration_cost_s=migration_cost,
                                    forecast=forecast, raised_by=raised_by)
        caught_up = live.newest_sample_id is None or last_id >= live.newest_sample_id
        why = live.why_not_live(now_s, config.sample_freshness_s) if caught_up else None
        if not caught_up or why is not None:
            state, raised_by = controller.observe(state, samples, gears, **args)
            cursor = make_cursor(state, last_id, run_key, raised_by, last_decline)
            if why is not None:
                return ShiftEvaluation(_hold(controller, state, f"hold: {why}", "not_live"), cursor, samples_read=read)
            if time.monotonic() - started_s < config.evaluation_budget_s:
                continue
            reason = (f"hold: reading a backlog of metric samples of run {run_key}: {read} read in this evaluation, "
                      f"up to t_s={samples[-1].t_s:g} of {live.newest_sample_t_s:g}; the decision waits until the "
                      f"newest is read")
            return ShiftEvaluation(_hold(controller, state, reason, "backlog"), cursor, samples_read=read, backlog=True)
        if samples[-1].instances > 1:  # a fleet of one gear serves: its scaler sizes it, a shift moves one pipeline
            state, raised_by = controller.observe(state, samples, gears, **args)
            reason = (f"hold: {samples[-1].instances} instances of gear {samples[-1].gear_id} serve; their fleet "
                      f"scaler adds and removes instances, and a gear shift would move only one of them")
            return ShiftEvaluation(_hold(controller, state, reason, "instances"),
                                   make_cursor(state, last_id, run_key, raised_by, last_decline), samples_read=read)
        new_state, decision = controller.decide(state, samples, gears, **args)
        if decision.action != "shift" and not decision.declined:
            return ShiftEvaluation(decision, make_cursor(new_state, last_id, run_key, None, last_decline),
                                   samples_read=read)
        if decision.declined:
            signature = decline_signature(decision.trigger, decision.reason_kind, decision.from_gear_id,
                                          decision.to_gear_id)
            if (last_decline is not None and last_decline[0] == signature
                    and decision.t_s - last_decline[1] < config.decline_repeat_s):
                return ShiftEvaluation(decision, make_cursor(new_state, last_id, run_key, None, last_decline),
                                       samples_read=read,
                                       note=f"alike the decline stored at t_s={last_decline[1]:g}: not stored again "
                                            f"within decline_repeat_s {config.decline_repeat_s:g} s")
            last_decline = (signature, float(decision.t_s))
        cursor = make_cursor(new_state, last_id, run_key, None, last_decline)
        key = decision_key(decision, run_key, run_key_prefix)
        event_id = db.record_shift_event(
            decision.action, "decided" if decision.action == "shift" else "declined", decision.reason,
            from_gear_key=decision.from_gear_id, to_gear_key=decision.to_gear_id, trigger=decision.trigger,
            est_gain=decision.estimated_gain_fraction, migration_cost_s=decision.migration_cost_s,
            run_key=run_key, details=decision.model_dump(), decision_key=key)
        return ShiftEvaluation(decision, cursor, event_id, key if decision.action == "shift" else None,
                               samples_read=read)


# -- offline admission ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TideEvaluation:
    """One evaluation of offline admission.

    ``decision`` is None before any online sample; ``admit`` the batch job rows to launch (marked
    ``admitted``), ``paused`` the keys of the jobs marked ``paused``, ``run_keys`` each admitted job's
    run key (:func:`admission_run_key`; n counts that job's admissions, kept in its store row); ``no_config``
    the keys of queued / paused jobs an admission skipped because their stored config is empty (no run stored one).
    """

    decision: TideDecision | None
    cursor: str
    admit: tuple[BatchJobRow, ...] = ()
    paused: tuple[str, ...] = ()
    run_keys: Mapping[str, str] = field(default_factory=dict)
    no_config: tuple[str, ...] = ()
    #: one line per serving run that left the tide in this evaluation (ended, or silent past the freshness bound)
    runs_left: tuple[str, ...] = ()


def admission_run_key(job_key: str, admission: int) -> str:
    """``batch:<job key>:admission-<n>``: the run key of a job's n-th admission (n from 1), unique per admission."""
    return f"batch:{job_key}:admission-{admission}"


def _admission_counts(db: TideStore, jobs: Sequence[BatchJobRow], legacy: Mapping[str, int]) -> dict[str, int]:
    """Each job's admissions so far (job key -> count), from the store; a count an old cursor kept (``legacy``,
    see :class:`~flexpipe_dag.control.cursor.TideCursor`) above the stored one is written to the store first."""
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.job_key] = max(j.admissions, legacy.get(j.job_key, 0))
        if counts[j.job_key] > j.admissions:
            db.update_job(j.id, admissions=counts[j.job_key])
    return counts


def _live_tide_runs(db: TideStore, runs: Mapping[str, RunTide], now_s: float,
                    freshness_s: float) -> tuple[dict[str, RunTide], tuple[str, ...]]:
    """The runs of ``runs`` still live (``why_not_live`` is None) and one line per run that left (ended, a batch
    job, or its samples or heartbeat older than ``freshness_s``)."""
    live: dict[str, RunTide] = {}
    left: list[str] = []
    for run_key, part in runs.items():
        why = db.pipeline_liveness(run_key).why_not_live(now_s, freshness_s,
                                                         consequence="its rate leaves the online tide")
        if why is None:
            live[run_key] = part
        else:
            left.append(why)
    return live, tuple(left)


def _fleet_capacity_rps(db: TideStore, runs: Mapping[str, RunTide]) -> float:
    """Req/s the live serving runs hold together: each run's gear's ``rps_max`` x its instances (inf when a run's
    gear is unknown: nothing bounds it)."""
    total = 0.0
    for part in runs.values():
        gear = db.load_gear(part.gear_id) if part.gear_id else None
        if gear is None:
            return float("inf")
        total += gear.rps_max * part.instances
    return total


#: A fresh tide cursor (the first evaluation, or a store reset) reads the online samples written in the last hour (or
#: twice the freshness bound, if longer) only: the rate's EMA forgets a sample within minutes (alpha 0.1 at a sample
#: every 2 s: 0.9^1800 of weight after an hour), a run silent for longer has left the tide anyway, and a store
#: holds weeks of them (the retention, ``FLEXPIPE_SAMPLE_RETENTION_DAYS``).
FRESH_TIDE_WINDOW_S = 3600.0


def _fresh_tide_rows(db: TideStore, now_s: float, freshness_s: float) -> tuple[list[tuple[int, str, MetricSample]],
                                                                              bool]:
    """The online samples a fresh cursor starts from (see :data:`FRESH_TIDE_WINDOW_S`), and whether any online
    sample exists at all (older ones only: the tide has been seen, no serving run is live)."""
    window_s = max(FRESH_TIDE_WINDOW_S, 2 * freshness_s)
    rows = db.read_run_samples(online_only=True, written_after_s=now_s - window_s)
    return rows, bool(rows) or bool(db.read_run_samples(online_only=True, limit=1))


def evaluate_tide(db: TideStore, cursor: str | None, tide: TideConfig, *, epoch_s: float | None = None,
                  forecaster: TideForecaster | None = None, now_s: float | None = None,
                  freshness_s: float = 120.0) -> TideEvaluation:
    """One evaluation of offline admission (see module docstring).

    Args:
        db: the store.
        cursor: what the previous evaluation returned (None / "" = start afresh).
        tide: the tide figures (thresholds, EMA alpha, hysteresis, time compression, history).
        epoch_s: now, epoch seconds (default the clock), placed in tide time with
            ``tide.time_compression``.
        forecaster: the tide history's forecaster (default: built from ``tide.history_file``).
        now_s: now on the wall clock, epoch seconds, for the runs' liveness (default the clock; ``epoch_s`` may
            be a tide time of the caller's choosing).
        freshness_s: a serving run whose newest sample or heartbeat is older than this (seconds;
            ``controller.sample_freshness_s``) has left the tide, as has a run that ended.

    The online tide is the fleet's: each serving run's rate is smoothed on its own (a batch job's pipeline, whose
    windows hold no online arrival, is left out) and the live runs' rates are added up, as are their capacities
    (each gear's ``rps_max`` x the instances its newest sample was merged from). A run that ended or fell silent
    leaves both sums: once no serving run is live, nothing online holds the fleet, and offline work is admitted
    (the decision's reason says so). A cursor whose last sample id is past the store's newest sample (the
    store was reset) starts afresh. The cursor keeps no per-job state (its size is bounded); each admission
    increments the job row's ``admissions``, which numbers its run key, so a job admitted again (paused, or
    finished and queued again) never repeats a run key Dagster has seen.

    Raises:
        InputError: ``cursor`` is not a tide cursor (:class:`~flexpipe_dag.control.cursor.TideCursor`,
            field named); the tide history cannot be read.
    """
    state = TideCursor.parse(cursor)
    cfg = tide
    now_s = time.time() if now_s is None else now_s
    seen, runs, last_id, gate = state.ema_rps is not None, dict(state.runs), state.last_sample_id, state.gate
    if last_id is None:
        rows, seen = _fresh_tide_rows(db, now_s, freshness_s)
    else:
        # the online stream only: a batch job's own pipeline samples no online arrival (rps 0 whatever the tide)
        rows = db.read_run_samples(after_id=last_id, online_only=True)
        if not rows and last_id > (db.newest_sample_id() or 0):
            # the store was reset (a new database under the same Dagster instance): read it afresh, not never
            runs, last_id, gate = {}, None, TideGate()
            rows, seen = _fresh_tide_rows(db, now_s, freshness_s)
    for _, run_key, smp in rows:
        before = runs.get(run_key)
        runs[run_key] = RunTide(ema_rps=ema(before.ema_rps if before else None, smp.rps, cfg.ema_alpha),
                                gear_id=smp.gear_id, instances=smp.instances)
    if rows:
        last_id = rows[-1][0]
    if not (seen or runs):
        return TideEvaluation(None, cursor or "{}")  # nothing seen yet: the cursor stays as it was
    runs, left = _live_tide_runs(db, runs, now_s, freshness_s)
    ema_rps = sum(part.ema_rps for part in runs.values())
    if forecaster is None:
        forecaster = TideForecaster(load_history(cfg))
    capacity = _fleet_capacity_rps(db, runs)
    # the unfinished jobs, not the weeks of finished ones; all of them once, to move an old cursor's counts
    batch_jobs = db.jobs(kind="batch", statuses=None if state.admissions else UNFINISHED_JOB_STATUSES)
    admissions = _admission_counts(db, batch_jobs, state.admissions)
    running = [j for j in batch_jobs if j.status == "running"]
    gate = gate.model_copy(update={"running": bool(running) or gate.running and any(
        j.status == "admitted" for j in batch_jobs)})
    decision = decide_offline(forecaster, cfg, tide_time_s=tide_time_s(epoch_s or time.time(), cfg.time_compression),
                              ema_rps=ema_rps, capacity_rps=capacity, offline_running=gate.running)
    if not runs:
        decision = dataclasses.replace(decision, reason=decision.reason + "; no serving run is live")
    elif len(runs) > 1:
        decision = dataclasses.replace(decision, reason=decision.reason + f" ({len(runs)} serving runs together)")
    gate, act = gate.step(decision, cfg.hysteresis_samples)
    admit: list[BatchJobRow] = []
    paused: list[str] = []
    no_config: list[str] = []
    if act is None:
        pass
    elif act.action == "pause":
        for j in running:  # compare-and-set: a cancel or an end written since the jobs were read stays
            if db.transition_job(j.id, "paused", ("running",)):
                paused.append(j.job_key)
    elif act.action == "admit":
        waiting = [j for j in batch_jobs if j.status in ("queued", "paused") and j.config]
        no_config = [j.job_key for j in batch_jobs if j.status in ("queued", "paused") and not j.config]
        for j in waiting:
            if db.transition_job(j.id, "admitted", ("queued", "paused"), admissions=admissions[j.job_key] + 1):
                admissions[j.job_key] += 1
                admit.append(j)
        # a Batch API batch is admitted (the front door serving it resumes it) but gets no batch_inference run
        admit = [j for j in admit if API_BATCH_CONFIG_KEY not in j.config]
    new_cursor = TideCursor(ema_rps=ema_rps, last_sample_id=last_id, gate=gate, runs=runs).dump()
    return TideEvaluation(decision if act is None else act, new_cursor, tuple(admit), tuple(paused),
                          {j.job_key: admission_run_key(j.job_key, admissions[j.job_key]) for j in admit},
                          tuple(no_config), left)
