"""Alembic migrations: one head, up/down/up with data in place, and no drift from the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from flexpipe_dag.sql.models import Base
from flexpipe_dag.sql.store import Store, current_revision, downgrade, head_revisions, migrate


def test_single_head():
    assert len(head_revisions()) == 1


def test_upgrade_downgrade_upgrade_with_data(engine, lab_profile):
    store = Store(engine)
    (head,) = head_revisions()
    assert current_revision(engine) == head
    store.save_profile(lab_profile)
    migrate(engine)  # idempotent at head
    assert len(store.list_profile_versions()) == 1
    downgrade(engine, "base", force=True)  # drops the stored profile (tests/test_security_store.py: refused unforced)
    assert current_revision(engine) is None
    assert "profile_versions" not in inspect(engine).get_table_names()
    migrate(engine)
    store = Store(engine)
    assert store.list_profile_versions() == []
    info = store.save_profile(lab_profile)
    assert store.load_profile(info.id).devices == lab_profile.devices


def test_models_match_migrations(engine):
    migrate(engine)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == [], f"models and migrations disagree; run alembic revision --autogenerate: {diff}"


def test_step_down_and_up_keeps_rows(engine, lab_profile):
    """Downgrading the newest revision and upgrading again keeps the data that was in place."""
    store = Store(engine)
    store.save_profile(lab_profile)
    job = store.get_or_create_job("j1", config={"trace": "azure-conv"})
    store.write_result(job, "r1", prompt_tokens=3, output_token_ids=[1, 2])
    (head,) = head_revisions()
    assert "0002 -> 0001: inference_jobs.config, the run configs of 1 jobs" in downgrade(engine, "0001", force=True)
    assert current_revision(engine) != head
    migrate(engine)
    store = Store(engine)
    assert store.done_request_keys(job) == {"r1"}
    assert len(store.list_profile_versions()) == 1
    assert store.jobs()[0].config == {}  # the column came back with its server default


def test_request_rate_columns_renamed_with_data_in_place(engine):
    """0005 renames gears.qps_* and metric_samples.qps to rps_* / rps, keeping rows; 0004 gives them back."""
    from sqlalchemy import inspect

    from flexpipe_dag.core.metrics import MetricSample

    store = Store(engine)
    store.write_samples("run-1", [MetricSample(t_s=2.0, gear_id="g", source="sim", rps=1.5, completed=1,
                                               tokens_per_s=1.0, queue_length=0, running=0, kv_used_fraction=0.0)])
    downgrade(engine, "0004")
    assert "qps" in {c["name"] for c in inspect(engine).get_columns("metric_samples")}
    migrate(engine)
    assert {"rps_min", "rps_max"} <= {c["name"] for c in inspect(engine).get_columns("gears")}
    assert [s.rps for _, s in Store(engine).read_samples("run-1")] == [1.5]
