"""Metric samples in the store: what the simulator and the live pipeline report every sampling period."""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

from sqlalchemy import CursorResult, delete, exists, func, select

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.core.settings import MIN_SAMPLE_RETENTION_S
from flexpipe_dag.core.status import PipelineRunKind, SampleSource, checked
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase, checked_finite, checked_int, checked_text

_T = TypeVar("_T")

#: Samples (pipeline rows, each with its stage rows) deleted per transaction by :meth:`MetricSamples.prune_samples`:
#: a server writing samples on SQLite waits for one chunk at most, never for the whole prune.
PRUNE_CHUNK_ROWS = 5000


@dataclass(frozen=True)
class PruneResult:
    """What :meth:`MetricSamples.prune_samples` deleted (or, on a dry run, would delete).

    Attributes:
        rows: ``metric_samples`` rows (pipeline and stage rows together) written before ``cutoff``.
        cutoff: rows written before this instant (UTC) are the old ones.
        dry_run: True when nothing was deleted (only counted).
    """

    rows: int
    cutoff: dt.datetime
    dry_run: bool

    def describe(self) -> str:
        """One line for a person: what went (or would go) and the cutoff."""
        verb = "would delete" if self.dry_run else "deleted"
        return (f"metric samples: {verb} {self.rows:,d} row(s) written before "
                f"{self.cutoff.isoformat(timespec='seconds')}")


def _held(row: Any, column: str, value: _T | None) -> _T:
    """``value`` of a column every row of ``row``'s scope holds (``row``: a ``metric_samples`` row, with its ``id``
    and ``scope``; :meth:`MetricSamples.write_samples` always sets the column; it is nullable only because the
    other scope leaves it empty).

    Raises:
        InputError: the column is NULL (a row written by something else); the row and column are named.
    """
    if value is None:
        raise InputError("metric_samples", f"row {row.id}: {column}", f"NULL in a {row.scope!r} row; expected a value")
    return value


#: Fields of a sample that are always measured: a finite number.
_FIGURES = ("t_s", "rps", "tokens_per_s", "kv_used_fraction")
#: Counts of a sample: an integer.
_COUNTS = ("completed", "queue_length", "running")
#: Latency percentiles: a finite number, or None when no request finished in the window.
_PERCENTILES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
#: Counts of a stage sample: an integer.
_STAGE_COUNTS = ("stage_index", "queue_length", "kv_blocks_used", "kv_blocks_total")


def _checked_sample(smp: MetricSample, context: str) -> MetricSample:
    """``smp`` with every figure checked and made a plain ``float`` / ``int`` (see
    :meth:`MetricSamples.write_samples` for what each field holds).

    Raises:
        InputError: ``metric_samples`` and the field named, ``context`` appended to the message.
    """
    where = "metric_samples"
    fields: dict[str, Any] = {"source": checked(SampleSource, smp.source, where, "source").value,
                              "gear_id": checked_text(smp.gear_id, where, "gear_id", 200)}
    fields.update({f: checked_finite(getattr(smp, f), where, f, context=context) for f in _FIGURES})
    fields.update({f: checked_int(getattr(smp, f), where, f, context=context) for f in _COUNTS})
    fields["instances"] = checked_int(smp.instances, where, "instances", context=context)
    if fields["instances"] < 1:
        raise InputError(where, "instances", f"{fields['instances']}{context}; expected at least 1 pipeline instance")
    fields.update({f: checked_finite(getattr(smp, f), where, f, optional=True, context=context)
                   for f in _PERCENTILES})
    stages = []
    for i, st in enumerate(smp.stages):
        stage: dict[str, Any] = {f: checked_int(getattr(st, f), where, f"stages[{i}].{f}", context=context)
                                 for f in _STAGE_COUNTS}
        stage["busy_fraction"] = checked_finite(st.busy_fraction, where, f"stages[{i}].busy_fraction",
                                                context=context)
        stages.append(StageSample(**stage))
    return replace(smp, **fields, stages=tuple(stages))


class MetricSamples(StoreBase):
    """Metric samples of serving runs: one ``pipeline`` row per sample and one ``stage`` row per stage
    under it (table ``metric_samples``).

    Raises:
        InputError: :meth:`write_samples` of a sample whose ``source`` is not a
            :class:`~flexpipe_dag.core.status.SampleSource` or whose figures are not finite numbers
            (see there; nothing of the batch is written).
    """

    def write_samples(self, run_key: str, samples: Iterable[MetricSample]) -> int:
        """Append metric samples (one pipeline row + one row per stage each); return rows written.

        Every figure is checked before anything is written: NaN and infinities are refused in every field,
        because none of them can be legitimate here and SQLite would store NaN as NULL, so every later
        :meth:`read_samples` of the run would fail. Per field:

        * ``t_s``, ``rps``, ``tokens_per_s``, ``kv_used_fraction`` and a stage's ``busy_fraction``: always
          measured over the window (a window with no arrivals has ``rps`` 0, an empty KV cache 0), so a
          finite number is required;
        * ``completed``, ``queue_length``, ``running`` and a stage's ``stage_index``, ``queue_length``,
          ``kv_blocks_used``, ``kv_blocks_total``: counts, so an integer is required (a float holding a
          whole number is stored as that integer);
        * the latency percentiles (``ttft_*``, ``tpot_*``, ``e2e_*``): ``None`` when no request finished in
          the window (the :class:`~flexpipe_dag.core.metrics.MetricSample` contract); NaN is not a way to
          say so.

        Raises:
            InputError: ``metric_samples`` and the field named (``stages[i].<field>`` for a stage sample;
                the 0-based batch item in the message); nothing of the batch is written: a ``source`` that
                is not a :class:`~flexpipe_dag.core.status.SampleSource`, a figure as above, or a
                ``run_key`` or ``gear_id`` that is not a string of at most 200 characters.
        """
        where = "metric_samples"
        checked_text(run_key, where, "run_key", 200)
        rows = [_checked_sample(smp, f" (batch item {i})") for i, smp in enumerate(samples)]
        written = 0
        with self.session() as s:
            for smp in rows:
                head = m.MetricSampleRow(
                    run_key=run_key, gear_key=smp.gear_id, source=smp.source, t_s=smp.t_s, scope="pipeline",
                    rps=smp.rps, completed=smp.completed, tokens_per_s=smp.tokens_per_s,
                    queue_length=smp.queue_length, running=smp.running, kv_used_fraction=smp.kv_used_fraction,
                    ttft_p50_ms=smp.ttft_p50_ms, ttft_p99_ms=smp.ttft_p99_ms, tpot_p50_ms=smp.tpot_p50_ms,
                    tpot_p99_ms=smp.tpot_p99_ms, e2e_p50_ms=smp.e2e_p50_ms, e2e_p99_ms=smp.e2e_p99_ms,
                    instances=smp.instances)
                s.add(head)
                s.flush()
                s.add_all(m.MetricSampleRow(
                    run_key=run_key, gear_key=smp.gear_id, source=smp.source, t_s=smp.t_s, scope="stage",
                    parent_id=head.id, stage_index=st.stage_index, busy_fraction=st.busy_fraction,
                    queue_length=st.queue_length, kv_blocks_used=st.kv_blocks_used,
                    kv_blocks_total=st.kv_blocks_total) for st in smp.stages)
                written += 1 + len(smp.stages)
        return written

    def prune_samples(self, keep_s: float, *, dry_run: bool = False, now_s: float | None = None,
                      chunk_rows: int = PRUNE_CHUNK_ROWS) -> PruneResult:
        """Delete the metric samples (pipeline and stage rows) written more than ``keep_s`` seconds ago.

        A serving run writes a pipeline row and one row per stage every sampling period (2 s): a store that serves
        for weeks keeps millions of them, which no reader needs (the sensors read from their cursors on, a run's
        report reads its own run). A sample goes whole (its pipeline row, chosen by when it was written, and its stage
        rows), in chunks of ``chunk_rows`` samples, each chunk its own transaction, oldest first, so a crash keeps
        what it has not reached and a concurrent writer waits for one chunk at most. The store's newest sample always
        stays (its id stands, so a sensor's cursor past the deleted rows reads on and never sees a reset store).

        Args:
            keep_s: the retention, seconds: rows written within the last ``keep_s`` seconds stay. At least
                :data:`~flexpipe_dag.core.settings.MIN_SAMPLE_RETENTION_S`.
            dry_run: only count the rows that would go.
            now_s: now, epoch seconds (default the clock).
            chunk_rows: samples (pipeline rows, with their stage rows) deleted per transaction (>= 1).

        Returns:
            The rows deleted (or counted: pipeline and stage rows) and the cutoff.

        Raises:
            InputError: ``keep_s`` not a finite number of at least ``MIN_SAMPLE_RETENTION_S`` seconds, or
                ``chunk_rows`` below 1 (nothing deleted).
        """
        if isinstance(keep_s, bool) or not isinstance(keep_s, (int, float)) or not math.isfinite(keep_s) \
                or keep_s < MIN_SAMPLE_RETENTION_S:
            raise InputError("metric_samples", "keep_s", f"expected a retention of at least "
                             f"{MIN_SAMPLE_RETENTION_S:g} s (the controller's windows read the last minutes to hours "
                             f"of samples), got {keep_s!r}")
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise InputError("metric_samples", "chunk_rows", f"expected an integer >= 1, got {chunk_rows!r}")
        cutoff = dt.datetime.fromtimestamp((time.time() if now_s is None else now_s) - keep_s, dt.UTC)
        table = m.MetricSampleRow.__table__.c
        newest = self.newest_sample_id()
        if newest is None:
            return PruneResult(0, cutoff, dry_run)
        # samples go whole, chosen by their pipeline row (a stage row is written a moment after it); the store's
        # newest sample always stays, so its id stands: a cursor past the deleted rows never reads as a reset store
        old = (table.scope == "pipeline") & (table.created_at < cutoff) & (table.id < newest)

        def stage_rows(heads: Any) -> Any:
            return (table.scope == "stage") & table.parent_id.in_(heads)

        if dry_run:
            with self.session() as s:
                heads = select(table.id).where(old).scalar_subquery()
                n = s.scalar(select(func.count()).where(old)) or 0
                return PruneResult(int(n) + int(s.scalar(select(func.count()).where(stage_rows(heads))) or 0),
                                   cutoff, True)
        deleted = 0
        while True:
            with self.session() as s:
                ids = list(s.scalars(select(table.id).where(old).order_by(table.id).limit(chunk_rows)))
                if not ids:
                    return PruneResult(deleted, cutoff, False)
                for rows in (stage_rows(ids), table.id.in_(ids)):  # stage rows first: no cascade relied on
                    gone = delete(m.MetricSampleRow).where(rows).execution_options(synchronize_session=False)
                    deleted += cast(CursorResult[Any], s.execute(gone)).rowcount

    def newest_sample_id(self) -> int | None:
        """Row id of the newest pipeline metric sample of any run, or None when there is none."""
        table = m.MetricSampleRow.__table__.c
        with self.session() as s:
            return s.scalar(select(table.id).where(table.scope == "pipeline").order_by(table.id.desc()).limit(1))

    def latest_sample_run_key(self) -> str | None:
        """The run that wrote the newest metric sample (the pipeline serving now), or None."""
        with self.session() as s:
            return s.scalar(select(m.MetricSampleRow.run_key).order_by(m.MetricSampleRow.id.desc()).limit(1))

    def read_samples(self, run_key: str | None = None, after_t_s: float | None = None,
                     after_id: int | None = None, limit: int | None = None,
                     online_only: bool = False) -> list[tuple[int, MetricSample]]:
        """Metric samples rebuilt from rows, oldest first, as ``(row_id, sample)`` pairs.

        ``after_id`` lets a sensor read only what arrived since its cursor; ``online_only`` leaves out the
        samples of runs registered as offline batch jobs (``pipeline_runs.kind`` ``batch``: a pipeline of
        their own whose windows hold no online arrivals, so their ``rps`` is 0 whatever the online load).

        Raises:
            InputError: a row lacks a value its scope always holds (row and column named).
        """
        return [(row_id, smp) for row_id, _, smp in self.read_run_samples(
            run_key=run_key, after_t_s=after_t_s, after_id=after_id, limit=limit, online_only=online_only)]

    def read_run_samples(self, run_key: str | None = None, after_t_s: float | None = None,
                         after_id: int | None = None, limit: int | None = None,
                         online_only: bool = False,
                         written_after_s: float | None = None) -> list[tuple[int, str, MetricSample]]:
        """:meth:`read_samples` with the run that wrote each sample: ``(row_id, run_key, sample)``, oldest first
        (the ``tide_sensor`` smooths each serving run's rate on its own and adds the live ones up).
        ``written_after_s`` (epoch seconds) keeps the samples written after it only (a fresh tide cursor reads the
        last hour, not the retention's weeks).

        Raises:
            InputError: as :meth:`read_samples`.
        """
        table = m.MetricSampleRow.__table__.c
        with self.session() as s:
            # plain rows, not ORM objects: a sensor reading a day's backlog builds 40,000+ samples
            q = select(*table).where(table.scope == "pipeline")
            if run_key is not None:
                q = q.where(table.run_key == run_key)
            if after_t_s is not None:
                q = q.where(table.t_s > after_t_s)
            if after_id is not None:
                q = q.where(table.id > after_id)
            if written_after_s is not None:
                q = q.where(table.created_at > dt.datetime.fromtimestamp(written_after_s, dt.UTC))
            if online_only:
                q = q.where(~exists().where(m.PipelineRun.run_key == table.run_key,
                                            m.PipelineRun.kind == PipelineRunKind.BATCH.value))
            q = q.order_by(table.id)
            if limit is not None:
                q = q.limit(limit)
            heads = s.execute(q).all()
            if not heads:
                return []
            stage_rows = s.execute(select(*table).where(table.scope == "stage", table.parent_id >= heads[0].id,
                                                        table.parent_id <= heads[-1].id).order_by(table.id)).all()
            wanted = {h.id for h in heads}
            stages: dict[int, list[StageSample]] = {}
            for r in stage_rows:
                parent = _held(r, "parent_id", r.parent_id)
                if parent not in wanted:  # a stage row of another run's sample in the same id range
                    continue
                stages.setdefault(parent, []).append(StageSample(
                    stage_index=_held(r, "stage_index", r.stage_index),
                    busy_fraction=_held(r, "busy_fraction", r.busy_fraction),
                    queue_length=_held(r, "queue_length", r.queue_length),
                    kv_blocks_used=_held(r, "kv_blocks_used", r.kv_blocks_used),
                    kv_blocks_total=_held(r, "kv_blocks_total", r.kv_blocks_total)))
            return [(h.id, h.run_key, MetricSample(
                t_s=h.t_s, gear_id=h.gear_key, source=h.source, rps=_held(h, "rps", h.rps),
                completed=_held(h, "completed", h.completed), tokens_per_s=_held(h, "tokens_per_s", h.tokens_per_s),
                queue_length=_held(h, "queue_length", h.queue_length), running=_held(h, "running", h.running),
                kv_used_fraction=_held(h, "kv_used_fraction", h.kv_used_fraction), ttft_p50_ms=h.ttft_p50_ms,
                ttft_p99_ms=h.ttft_p99_ms, tpot_p50_ms=h.tpot_p50_ms, tpot_p99_ms=h.tpot_p99_ms,
                e2e_p50_ms=h.e2e_p50_ms, e2e_p99_ms=h.e2e_p99_ms, stages=tuple(stages.get(h.id, ())),
                instances=h.instances or 1))
                for h in heads]
