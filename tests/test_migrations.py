"""Alembic migrations: one head, up/down/up with data in place, and no drift from the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from sql.models import Base
from sql.store import Store, current_revision, downgrade, head_revisions, migrate


def test_single_head():
    assert len(head_revisions()) == 1


def test_upgrade_downgrade_upgrade_with_data(engine, lab_profile):
    store = Store(engine)
    (head,) = head_revisions()
    assert current_revision(engine) == head
    store.save_profile(lab_profile)
    migrate(engine)  # idempotent at head
    assert len(store.list_profile_versions()) == 1
    downgrade(engine, "base")
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
