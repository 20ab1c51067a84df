"""Metric-sample retention: ``Store.prune_samples``, ``flexpipe store prune`` and the ``store_retention`` job.

A server writes a pipeline row and one row per stage every 2 s; a store serving for weeks is pruned to the
retention, in chunks, without touching what the sensors and live runs still read."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import func, select, update

from flexpipe_dag.cli import main
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.sql import models as m


def _samples(n: int, t0: float = 0.0, stages: int = 2) -> list[MetricSample]:
    return [MetricSample(t_s=t0 + 2.0 * i, gear_id="g", source="live", rps=1.0 + i, completed=1, tokens_per_s=10.0,
                         queue_length=0, running=1, kv_used_fraction=0.2,
                         stages=tuple(StageSample(k, 0.5, 0, 3, 100) for k in range(stages))) for i in range(n)]


def _rows(store) -> int:
    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(m.MetricSampleRow)))


def _age(store, run_key: str, days: float) -> None:
    """Make every row of ``run_key`` (pipeline and stage rows) look written ``days`` days ago."""
    when = dt.datetime.now(dt.UTC) - dt.timedelta(days=days)
    t = m.MetricSampleRow.__table__.c
    with store.session() as s:
        heads = select(t.id).where(t.run_key == run_key).scalar_subquery()
        s.execute(update(m.MetricSampleRow.__table__).where(t.id.in_(heads) | t.parent_id.in_(heads))
                  .values(created_at=when))


def test_prune_deletes_old_rows_with_their_stage_rows_in_chunks_and_keeps_the_rest(store):
    store.write_samples("old", _samples(7))  # 7 pipeline + 14 stage rows
    store.write_samples("new", _samples(3, t0=100.0))
    _age(store, "old", days=20)
    assert _rows(store) == 30
    dry = store.prune_samples(14 * 86400, dry_run=True)
    assert dry.rows == 21 and dry.dry_run and _rows(store) == 30  # counted, nothing deleted
    assert dry.describe().startswith("metric samples: would delete 21 row(s) written before ")
    done = store.prune_samples(14 * 86400, chunk_rows=4)  # chunks smaller than a sample's rows
    assert done.rows == 21 and not done.dry_run and _rows(store) == 9
    kept = store.read_run_samples()
    assert [rk for _, rk, _ in kept] == ["new"] * 3 and all(len(smp.stages) == 2 for _, _, smp in kept)
    assert store.prune_samples(14 * 86400).rows == 0  # nothing old left


def test_a_cursor_past_the_pruned_rows_reads_on(store):
    store.write_samples("serve-1", _samples(5))
    last_id = store.read_samples("serve-1")[-1][0]
    _age(store, "serve-1", days=30)
    store.write_samples("serve-1", _samples(2, t0=10.0))
    store.prune_samples(86400)
    assert [smp.t_s for _, smp in store.read_samples("serve-1", after_id=last_id)] == [10.0, 12.0]
    assert store.newest_sample_id() is not None and store.newest_sample_id() > last_id


@pytest.mark.parametrize("keep_s", [0, 3599.0, float("nan"), float("inf"), -1, True, "7"])
def test_a_retention_under_an_hour_or_not_a_number_is_refused_and_deletes_nothing(store, keep_s):
    store.write_samples("old", _samples(2))
    _age(store, "old", days=400)
    with pytest.raises(InputError) as err:
        store.prune_samples(keep_s)
    assert err.value.field == "keep_s" and "at least 3600 s" in err.value.problem
    assert _rows(store) == 6


def test_cli_prune_checks_the_retention_before_opening_the_store(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", f"sqlite:///{tmp_path / 'never.db'}")
    assert main(["store", "prune", "--keep-days", "0.01"]) == 2
    assert "--keep-days: expected a finite number >= 0.0416667 and <= 3650 (days), got 0.01" in capsys.readouterr().err
    assert not (tmp_path / "never.db").exists()
    monkeypatch.setenv("FLEXPIPE_SAMPLE_RETENTION_DAYS", "forever")
    assert main(["store", "prune"]) == 2
    assert "environment variable FLEXPIPE_SAMPLE_RETENTION_DAYS: expected a number" in capsys.readouterr().err


def test_cli_prune_deletes_what_the_retention_leaves_out(capsys, monkeypatch, tmp_path):
    from flexpipe_dag.sql.store import Store

    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", url)
    store = Store.from_url(url)
    store.write_samples("old", _samples(4))
    store.write_samples("new", _samples(1))
    _age(store, "old", days=3)
    assert main(["store", "prune", "--keep-days", "7", "--dry-run"]) == 0
    assert "would delete 0 row(s)" in capsys.readouterr().out
    monkeypatch.setenv("FLEXPIPE_SAMPLE_RETENTION_DAYS", "2")
    assert main(["store", "prune"]) == 0
    assert "metric samples: deleted 12 row(s) written before " in capsys.readouterr().out
    assert _rows(store) == 3


def test_the_store_retention_job_prunes_and_its_schedule_is_nightly(tmp_path, monkeypatch):
    from flexpipe_dag.definitions import build_resources, defs
    from flexpipe_dag.jobs.retention import store_retention
    from flexpipe_dag.resources.store_resource import StoreResource

    url = f"sqlite:///{tmp_path / 'store.db'}"
    res = StoreResource(database_url=url)
    store = res.get_store()
    store.write_samples("old", _samples(2))
    store.write_samples("new", _samples(2))
    _age(store, "old", days=1.5)
    run = store_retention.execute_in_process(
        run_config={"ops": {"prune_metric_samples": {"config": {"keep_days": 1.0}}}}, resources={"store": res})
    assert run.success and run.output_for_node("prune_metric_samples") == 6 and _rows(store) == 6
    bad = store_retention.execute_in_process(
        run_config={"ops": {"prune_metric_samples": {"config": {"keep_days": 0.001}}}}, resources={"store": res},
        raise_on_error=False)
    assert not bad.success and "keep_days: expected a finite number >= 0.0416667" in str(bad.all_events)
    schedule = defs.resolve_schedule_def("store_retention_schedule")
    assert schedule.cron_schedule == "0 3 * * *" and schedule.job_name == "store_retention"
    monkeypatch.setenv("FLEXPIPE_SAMPLE_RETENTION_DAYS", "0")  # a bad retention fails the code location's load
    with pytest.raises(InputError, match="FLEXPIPE_SAMPLE_RETENTION_DAYS"):
        build_resources()


def test_a_fresh_tide_cursor_reads_the_last_hour_not_the_retentions_weeks(store):
    """A new tide cursor read every online sample the store held (weeks of them under the retention) and logged each
    long-gone run as leaving the tide; it now starts from the samples written in the last hour."""
    import json

    from flexpipe_dag.control.service import evaluate_tide
    from flexpipe_dag.control.tide import TideConfig

    store.write_samples("serve-last-week", _samples(50))
    _age(store, "serve-last-week", days=7)
    ev = evaluate_tide(store, None, TideConfig())
    # only old samples: the tide has been seen and no serving run is live (offline work may use the fleet)
    assert ev.decision is not None and ev.decision.reason.endswith("no serving run is live") and ev.runs_left == ()
    assert json.loads(ev.cursor)["runs"] == {}
    store.write_samples("serve-now", _samples(3))
    ev = evaluate_tide(store, None, TideConfig())
    assert list(json.loads(ev.cursor)["runs"]) == ["serve-now"] and ev.runs_left == ()
    assert json.loads(ev.cursor)["last_sample_id"] == store.newest_sample_id()


def test_an_idle_store_keeps_its_newest_sample_and_the_tide_still_decides(store):
    """Seen in review: a prune that emptied an idle store made the tide sensor's cursor read as a reset store (its
    last id past the newest), and with no sample left it decided nothing ("no online metric samples yet") where the
    tick before had admitted offline work; on SQLite the ids would also start again at 1."""
    from flexpipe_dag.control.service import evaluate_tide
    from flexpipe_dag.control.tide import TideConfig

    store.write_samples("serve-1", _samples(6))
    before = evaluate_tide(store, None, TideConfig(), now_s=10**10)  # long after: the run has left, none is live
    assert before.decision is not None and before.decision.reason.endswith("no serving run is live")
    newest = store.newest_sample_id()
    _age(store, "serve-1", days=30)
    assert store.prune_samples(86400, dry_run=True).rows == 15  # 5 of 6 samples, 3 rows each
    assert store.prune_samples(86400, chunk_rows=2).rows == 15
    assert store.newest_sample_id() == newest and [i for i, _ in store.read_samples()] == [newest] and _rows(store) == 3
    after = evaluate_tide(store, before.cursor, TideConfig(), now_s=10**10)
    assert after.decision is not None and after.decision.reason.endswith("no serving run is live")
    assert store.prune_samples(86400).rows == 0  # the newest always stays


def test_a_dry_run_writes_nothing_not_even_a_schema_upgrade(capsys, monkeypatch, tmp_path):
    from flexpipe_dag.sql.store import Store, current_revision, downgrade, make_engine

    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", url)
    engine = make_engine(url)
    Store(engine)
    downgrade(engine, "0014")
    assert main(["store", "prune", "--dry-run"]) == 2
    assert "flexpipe store upgrade" in capsys.readouterr().err
    assert current_revision(engine) == "0014"
    assert main(["store", "prune"]) == 0  # a real prune migrates, as every command that writes does
    assert current_revision(engine) != "0014"
    engine.dispose()
