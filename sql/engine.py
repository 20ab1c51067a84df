"""Engines and schema migrations of the FlexPipe store.

SQLite (WAL mode, foreign keys on) under ``FLEXPIPE_HOME`` by default; PostgreSQL when
``FLEXPIPE_DATABASE_URL`` is set. Migrations are the Alembic scripts packaged in ``sql/migrations``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import database_url

_SQL_DIR = Path(__file__).resolve().parent


def make_engine(url: str | None = None, **engine_kwargs: Any) -> Engine:
    """Create an engine for ``url`` (default: :func:`database_url`), with SQLite set up for WAL.

    ``engine_kwargs`` go to :func:`sqlalchemy.create_engine` (e.g. ``connect_args``).
    """
    url = url or database_url()
    engine = create_engine(url, **engine_kwargs)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # pragma: no cover - exercised by every SQLite test
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()
    return engine


def alembic_config(engine: Engine | None = None) -> Config:
    """Alembic config pointing at the packaged migrations (``sql/migrations``)."""
    cfg = Config(str(_SQL_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(_SQL_DIR / "migrations"))
    if engine is not None:
        cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def _run_alembic(engine: Engine, fn: Callable[[Config, str], None], revision: str) -> None:
    """Run an Alembic command on one connection.

    On SQLite, foreign keys are switched off for the migration: a batch ALTER recreates the table,
    and with ``ON DELETE CASCADE`` enforced, dropping the old copy would delete its child rows.
    """
    cfg = alembic_config(engine)
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        try:
            with conn.begin():
                cfg.attributes["connection"] = conn
                fn(cfg, revision)
        finally:
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database behind ``engine`` to ``revision`` (idempotent)."""
    _run_alembic(engine, command.upgrade, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Downgrade the database behind ``engine`` to ``revision`` (``"base"`` drops everything)."""
    _run_alembic(engine, command.downgrade, revision)


def current_revision(engine: Engine) -> str | None:
    """The Alembic revision the database behind ``engine`` is at (``None``: no schema yet)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revisions() -> tuple[str, ...]:
    """The head revision(s) of the packaged migrations (one, unless two branches were left unmerged)."""
    return tuple(ScriptDirectory.from_config(alembic_config()).get_heads())


def check_store_url(url: str, source: str = "FLEXPIPE_DATABASE_URL") -> str:
    """Check a store URL without connecting; return it for messages (password hidden).

    An in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``, ``file::memory:`` or
    ``mode=memory`` URIs) is refused: every process and every pooled connection would get its own
    empty database, so what one Dagster run or stage worker wrote would be invisible to the next and
    vanish on exit.

    Raises:
        InputError: ``source`` named; the URL does not parse, or it names an in-memory database.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise InputError(source, None,
                         f"{url!r} is not a database URL; expected e.g. sqlite:///path/flexpipe.db or "
                         "postgresql+psycopg2://user@host:5432/db") from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite":
        database = (parsed.database or "").strip()
        mode = parsed.query.get("mode")
        modes = (mode,) if isinstance(mode, str) else tuple(mode or ())
        if database in ("", ":memory:") or database.startswith("file::memory:") or "memory" in modes \
                or "mode=memory" in database:
            raise InputError(source, None,
                             f"{url.strip()!r} is an in-memory SQLite database: every process and connection would get "
                             "its own empty store and results would vanish; expected a file, e.g. "
                             "sqlite:////abs/path/flexpipe.db (or leave FLEXPIPE_DATABASE_URL unset for "
                             "$FLEXPIPE_HOME/flexpipe.db)")
    return shown
