"""Sample-writing runs in the store: which serving runs and batch jobs are live (table ``pipeline_runs``).

A serving run heartbeats at every control step and ends when it stops; a batch job registers as
``batch`` and ends likewise. The gear-shift service follows only a live serving run
(:meth:`PipelineRuns.latest_shiftable_run_key`) and checks its liveness before it records a shift
(:meth:`PipelineRuns.pipeline_liveness`, read with
:meth:`~flexpipe_dag.core.liveness.PipelineLiveness.why_not_live`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import and_, exists, or_, select

from flexpipe_dag.core.clock import as_utc
from flexpipe_dag.core.liveness import PipelineLiveness
from flexpipe_dag.core.status import PipelineRunKind, checked
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.models import utcnow
from flexpipe_dag.sql.session import StoreBase, checked_text


def epoch_s(when: dt.datetime | None) -> float | None:
    """``when`` as epoch seconds (a naive datetime, as SQLite gives back, is UTC), or None."""
    return None if when is None else as_utc(when).timestamp()


@dataclass(frozen=True)
class ServingRunInfo:
    """A serving run as the store knows it (times are epoch seconds).

    Attributes:
        run_key, kind: its key and :class:`~flexpipe_dag.core.status.PipelineRunKind`.
        gear_key: the gear serving at its last heartbeat (None: not told yet).
        endpoint: the base URL its clients use (``http://HOST:PORT/v1``), None for a run without an API.
        started_at_s, heartbeat_at_s: when it registered and when it last said it is alive.
        inline_control: it decides its own shifts.
    """

    run_key: str
    kind: str
    gear_key: str | None
    endpoint: str | None
    started_at_s: float
    heartbeat_at_s: float
    inline_control: bool


class PipelineRuns(StoreBase):
    """Serving runs and batch jobs that write metric samples, with their liveness (table ``pipeline_runs``).

    Raises:
        InputError: a write with a ``kind`` that is not a :class:`~flexpipe_dag.core.status.PipelineRunKind`,
            or a run key or gear key that is not a string of at most 200 characters (nothing written).
    """

    def heartbeat_pipeline_run(self, run_key: str, kind: str, gear_key: str | None = None, *,
                               inline_control: bool = False, endpoint: str | None = None) -> None:
        """Register ``run_key`` on its first call, then record that it is alive now (and the gear it serves).

        ``inline_control``: the run decides its own shifts (a serve loop with inline control);
        :meth:`latest_shiftable_run_key` then never names it, so the ``gear_shift_sensor`` does not decide on
        it too. ``endpoint``: the base URL clients reach it at, once known (a front door bound to port 0
        learns it after its first heartbeat). A run that has ended stays ended (a late heartbeat does not bring
        it back).
        """
        where = "pipeline_runs"
        kind = checked(PipelineRunKind, kind, where, "kind").value
        checked_text(run_key, where, "run_key", 200)
        checked_text(gear_key, where, "gear_key", 200, optional=True)
        checked_text(endpoint, where, "endpoint", 300, optional=True)
        with self.session() as s:
            run = s.scalar(select(m.PipelineRun).where(m.PipelineRun.run_key == run_key))
            if run is None:
                s.add(m.PipelineRun(run_key=run_key, kind=kind, gear_key=gear_key, inline_control=inline_control,
                                    endpoint=endpoint))
                return
            run.heartbeat_at = utcnow()
            run.inline_control = inline_control
            if gear_key is not None:
                run.gear_key = gear_key
            if endpoint is not None:
                run.endpoint = endpoint

    def end_pipeline_run(self, run_key: str) -> None:
        """Mark ``run_key`` ended (its samples never trigger a shift again); a run never registered is left alone."""
        with self.session() as s:
            run = s.scalar(select(m.PipelineRun).where(m.PipelineRun.run_key == run_key))
            if run is not None and run.ended_at is None:
                run.ended_at = utcnow()

    def live_serving_runs(self, max_heartbeat_age_s: float = 30.0) -> list[ServingRunInfo]:
        """Serving runs not ended whose last heartbeat is at most ``max_heartbeat_age_s`` old, newest
        heartbeat first (a server that died without ending its run drops out once its heartbeat ages)."""
        since = utcnow() - dt.timedelta(seconds=max_heartbeat_age_s)
        with self.session() as s:  # compared in Python: SQLite keeps datetimes naive
            rows = s.scalars(select(m.PipelineRun).where(
                m.PipelineRun.kind == PipelineRunKind.SERVE.value, m.PipelineRun.ended_at.is_(None))).all()
            runs = [ServingRunInfo(run_key=r.run_key, kind=r.kind, gear_key=r.gear_key, endpoint=r.endpoint,
                                   started_at_s=as_utc(r.started_at).timestamp(),
                                   heartbeat_at_s=as_utc(r.heartbeat_at).timestamp(),
                                   inline_control=bool(r.inline_control))
                    for r in rows if as_utc(r.heartbeat_at) >= since]
        return sorted(runs, key=lambda r: -r.heartbeat_at_s)

    def pipeline_liveness(self, run_key: str) -> PipelineLiveness:
        """What the store knows of ``run_key``'s liveness: its registration and its newest metric sample."""
        with self.session() as s:
            run = s.scalar(select(m.PipelineRun).where(m.PipelineRun.run_key == run_key))
            newest = s.execute(select(m.MetricSampleRow.id, m.MetricSampleRow.t_s, m.MetricSampleRow.created_at)
                               .where(m.MetricSampleRow.run_key == run_key, m.MetricSampleRow.scope == "pipeline")
                               .order_by(m.MetricSampleRow.id.desc()).limit(1)).first()
            return PipelineLiveness(
                run_key=run_key, kind=run.kind if run else None, ended_at_s=epoch_s(run.ended_at) if run else None,
                heartbeat_at_s=epoch_s(run.heartbeat_at) if run else None,
                newest_sample_id=newest.id if newest else None, newest_sample_t_s=newest.t_s if newest else None,
                newest_sample_written_s=epoch_s(newest.created_at) if newest else None,
                inline_control=bool(run.inline_control) if run else False, gear_key=run.gear_key if run else None)

    def recent_shiftable_run_keys(self, window_samples: int = 1000) -> list[str]:
        """The runs the ``gear_shift_sensor`` could follow (as :meth:`latest_shiftable_run_key` reads them) among
        those that wrote the newest ``window_samples`` pipeline samples, newest writer first: more than one means
        several live serving runs share the store, and the sensor follows each on its own."""
        with self.session() as s:
            recent = s.execute(select(m.MetricSampleRow.run_key).where(m.MetricSampleRow.scope == "pipeline")
                               .order_by(m.MetricSampleRow.id.desc()).limit(window_samples)).scalars().all()
            keys = list(dict.fromkeys(recent))
            excluded = set(s.scalars(select(m.PipelineRun.run_key).where(
                m.PipelineRun.run_key.in_(keys), or_(m.PipelineRun.ended_at.is_not(None),
                                                     m.PipelineRun.kind == PipelineRunKind.BATCH.value,
                                                     m.PipelineRun.inline_control.is_(True)))))
            return [k for k in keys if k not in excluded]

    def latest_shiftable_run_key(self) -> str | None:
        """The run that wrote the newest metric sample among those the ``gear_shift_sensor`` may follow: not a
        batch job, not ended and not deciding its own shifts (``inline_control``; a run never registered counts:
        its samples' freshness decides), or None. One run per store: with two such runs live, the newest
        sample's."""
        not_followed = exists().where(and_(m.PipelineRun.run_key == m.MetricSampleRow.run_key,
                                           or_(m.PipelineRun.ended_at.is_not(None),
                                               m.PipelineRun.kind == PipelineRunKind.BATCH.value,
                                               m.PipelineRun.inline_control.is_(True))))
        with self.session() as s:
            return s.scalar(select(m.MetricSampleRow.run_key).where(m.MetricSampleRow.scope == "pipeline", ~not_followed)
                            .order_by(m.MetricSampleRow.id.desc()).limit(1))
