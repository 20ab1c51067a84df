"""Shared fixtures: a fresh store on SQLite and on the local PostgreSQL server.

Only fixtures live here; helpers and constants shared by the test modules are in
``tests/support.py`` (``from tests.support import ...``; never ``import conftest``)."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support import EXAMPLES, MODEL_CACHE, PG_URL

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Every test gets its own FLEXPIPE_HOME (its runtime lock with it) and no FLEXPIPE_DATABASE_URL."""
    monkeypatch.setenv("FLEXPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FLEXPIPE_MODEL_CACHE", MODEL_CACHE)
    monkeypatch.delenv("FLEXPIPE_DATABASE_URL", raising=False)
    monkeypatch.delenv("FLEXPIPE_RUNTIME_LOCK", raising=False)


def _pg_engine_or_skip():
    sqlalchemy = pytest.importorskip("sqlalchemy")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        pytest.skip("psycopg2 is not installed (pip install -e .[postgres])")
    from flexpipe_dag.sql.store import make_engine

    admin = make_engine(PG_URL, connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as conn:
            conn.execute(sqlalchemy.text("select 1"))
    except sqlalchemy.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL at {PG_URL} is unreachable: {str(exc).splitlines()[0]}")
    return admin


@pytest.fixture
def postgres_engine():
    """An engine on a fresh schema of the local PostgreSQL ``test`` database (dropped afterwards)."""
    import sqlalchemy

    from flexpipe_dag.sql.store import make_engine

    admin = _pg_engine_or_skip()
    schema = f"fp_{uuid.uuid4().hex[:12]}"
    with admin.begin() as conn:
        conn.execute(sqlalchemy.text(f'CREATE SCHEMA "{schema}"'))
    engine = make_engine(PG_URL, connect_args={"options": f"-csearch_path={schema}"})
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(sqlalchemy.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def sqlite_engine(tmp_path):
    from flexpipe_dag.sql.store import make_engine

    engine = make_engine(f"sqlite:///{tmp_path / 'store.db'}")
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request):
    """The store's engine, once on SQLite and once on PostgreSQL."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture
def store(engine):
    from flexpipe_dag.sql.store import Store

    return Store(engine)


@pytest.fixture
def lab_profile():
    from flexpipe_dag.core.cluster import load_cluster_profile

    return load_cluster_profile(EXAMPLES / "fragmented_lab.yaml")
