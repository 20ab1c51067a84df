"""Schema migrations of the FlexPipe store: upgrade, guarded downgrade, schema check and repair.

Every migration runs in one transaction on one connection (SQLite DDL is transactional, see
:mod:`flexpipe_dag.sql.engine`), so a process killed mid-migration leaves the store as it was.
Migrations are serialised across processes: on SQLite by a file lock beside the database
(``<file>.migrate.lock``) and ``BEGIN IMMEDIATE``; on PostgreSQL by a transaction-level advisory lock
per schema. A store left with FlexPipe tables but no schema version (a first migration of an older
FlexPipe that was killed) is repaired on the next upgrade when those tables are empty, and named
with the command that repairs it (:data:`REPAIR_COMMAND`) when they hold rows.

A downgrade that would drop data refuses unless forced, naming what it drops: each migration module
may define ``data_lost_by_downgrade(conn) -> list[str]``, what its ``downgrade()`` would destroy in the
store as it is now (:func:`downgrade_losses` asks every step between the current and the target revision).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, func, inspect, select, table, text

from flexpipe_dag.core.errors import InputError, first_line, shown
from flexpipe_dag.sql.engine import IMMEDIATE, alembic_config, shown_url
from flexpipe_dag.sql.models import Base

#: The command that upgrades a store to this FlexPipe's schema (named by every "old schema" error).
UPGRADE_COMMAND = "flexpipe store upgrade"
#: The command that drops a half-migrated store's unversioned tables and creates the schema afresh.
REPAIR_COMMAND = "flexpipe store repair --force"
#: How long a process waits for another process's migration of the same SQLite store, in seconds.
MIGRATION_LOCK_TIMEOUT_S = 600.0


@functools.lru_cache(maxsize=1)
def _script() -> ScriptDirectory:
    """The packaged migration scripts (read once per process)."""
    return ScriptDirectory.from_config(alembic_config())


def head_revisions() -> tuple[str, ...]:
    """The head revision(s) of the packaged migrations (one, unless two branches were left unmerged)."""
    return tuple(_script().get_heads())


def current_revision(engine: Engine) -> str | None:
    """The Alembic revision the database behind ``engine`` is at (``None``: no schema yet)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def row_count(conn: Connection, table_name: str, where: str = "") -> int:
    """Rows of ``table_name`` (matching the SQL condition ``where``, if given) on ``conn``."""
    return int(conn.scalar(text(f"SELECT count(*) FROM {table_name}" + (f" WHERE {where}" if where else ""))) or 0)


def _lock_file(engine: Engine) -> Path | None:
    """The migration lock file of a SQLite store (None: not SQLite, or no file path to put it beside)."""
    database = engine.url.database or ""
    if engine.dialect.name != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database).expanduser().resolve().with_name(Path(database).name + ".migrate.lock")


@contextmanager
def migration_transaction(engine: Engine) -> Iterator[Connection]:
    """One connection in one transaction that holds the store's cross-process migration lock.

    On SQLite foreign keys are switched off meanwhile: a batch ALTER recreates a table, and with
    ``ON DELETE CASCADE`` enforced, dropping the old copy would delete its child rows.

    Raises:
        InputError: another process held the SQLite migration lock for :data:`MIGRATION_LOCK_TIMEOUT_S`.
    """
    import filelock

    path = _lock_file(engine)
    lock = filelock.FileLock(str(path), timeout=MIGRATION_LOCK_TIMEOUT_S) if path is not None else nullcontext()
    try:
        with lock, engine.connect() as conn:
            sqlite = conn.dialect.name == "sqlite"
            if sqlite:  # a PRAGMA inside a transaction does nothing: run it before BEGIN, on the driver connection
                conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
            try:
                with conn.execution_options(**IMMEDIATE).begin():
                    if conn.dialect.name == "postgresql":
                        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtext('flexpipe-migrate:' || current_schema()))")
                    yield conn
            finally:
                if sqlite:
                    conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=ON")  # type: ignore[union-attr]
    except filelock.Timeout:
        raise InputError(shown_url(engine.url), None,
                         f"another process has held the migration lock {path} for {MIGRATION_LOCK_TIMEOUT_S:g} s; "
                         "expected its migration to finish (is one stuck?)") from None


def _unversioned_tables(conn: Connection) -> dict[str, int]:
    """FlexPipe tables present while no schema version is stamped, with their row counts ({} when stamped)."""
    if MigrationContext.configure(conn).get_current_revision() is not None:
        return {}
    names = sorted(set(inspect(conn).get_table_names()) & set(Base.metadata.tables))
    return {name: int(conn.scalar(select(func.count()).select_from(table(name))) or 0) for name in names}


def _drop_unversioned(conn: Connection, engine: Engine, force: bool) -> None:
    """Drop the tables of a half-migrated store (see the module docstring) so the upgrade starts afresh.

    Raises:
        InputError: some of them hold rows and not ``force`` (the tables and :data:`REPAIR_COMMAND` named).
    """
    found = _unversioned_tables(conn)
    if not found:
        return
    full = {name: rows for name, rows in found.items() if rows}
    if full and not force:
        held = ", ".join(f"{name} ({rows} rows)" for name, rows in full.items())
        raise InputError(shown_url(engine.url), "alembic_version",
                         f"the store holds FlexPipe tables but no schema version (a first migration that was "
                         f"interrupted?) and {held} hold data; expected a versioned store: back it up, then run "
                         f"`{REPAIR_COMMAND}` to drop these tables and create the schema afresh")
    Base.metadata.drop_all(conn, tables=[Base.metadata.tables[name] for name in found])


def _alembic(engine: Engine, conn: Connection, fn: Callable[[Config, str], None], revision: str) -> None:
    """Run an Alembic command on ``conn`` (already in the migration transaction).

    Raises:
        InputError: Alembic does not know ``revision`` or the store's revision (a newer FlexPipe migrated it).
    """
    cfg = alembic_config(engine)
    cfg.attributes["connection"] = conn
    try:
        fn(cfg, revision)
    except (CommandError, RevisionError) as exc:
        raise InputError(shown_url(engine.url), "schema revision",
                         f"{shown(str(exc).strip() or type(exc).__name__)} (asked for {shown(revision, 64)}); expected "
                         f"one of this FlexPipe's revisions (base .. {', '.join(head_revisions())}): a store migrated "
                         "by a newer FlexPipe needs that FlexPipe") from None


def migrate(engine: Engine, revision: str = "head", *, drop_unversioned: bool = False) -> None:
    """Upgrade the database behind ``engine`` to ``revision`` (idempotent, atomic, one process at a time).

    A half-migrated store (FlexPipe tables, no version) is repaired when its tables are empty, or
    with ``drop_unversioned`` (their rows are lost).

    Raises:
        InputError: the store is half-migrated and holds rows (without ``drop_unversioned``); its revision
            or ``revision`` is unknown; the migration lock could not be taken.
    """
    if revision == "head" and not drop_unversioned and current_revision(engine) in head_revisions():
        return  # the common case: no lock, no transaction
    with migration_transaction(engine) as conn:
        _drop_unversioned(conn, engine, force=drop_unversioned)
        _alembic(engine, conn, command.upgrade, revision)


def require_current(engine: Engine) -> None:
    """Check that the store behind ``engine`` is at this FlexPipe's schema head (for a store opened without migrating).

    Raises:
        InputError: the store has no schema or an older (or unknown) one; names :data:`UPGRADE_COMMAND`.
    """
    heads = head_revisions()
    rev = current_revision(engine)
    if rev in heads:
        return
    if rev is None or _known(rev):
        state = "has no schema yet" if rev is None else f"is at schema revision {rev}"
        raise InputError(shown_url(engine.url), "schema revision",
                         f"the store {state}; expected {', '.join(heads)}: run `{UPGRADE_COMMAND}` (with the same "
                         "FLEXPIPE_DATABASE_URL) or open it with auto-migration")
    raise InputError(shown_url(engine.url), "schema revision",
                     f"the store is at schema revision {rev}, unknown to this FlexPipe (expected "
                     f"{', '.join(heads)}): a newer FlexPipe migrated it; use that one")


def _known(rev: str) -> bool:
    try:
        return _script().get_revision(rev) is not None
    except (CommandError, RevisionError):
        return False


def downgrade_losses(conn: Connection, revision: str) -> list[str]:
    """What downgrading the store on ``conn`` to ``revision`` would destroy, one entry per loss, e.g.
    ``"0003 -> 0002: table stage_observations (12 rows)"``; [] when nothing holding data is dropped.

    Raises:
        InputError: ``revision`` is unknown or not below the store's current revision.
    """
    current = MigrationContext.configure(conn).get_current_revision()
    if not (isinstance(revision, str) and 0 < len(revision) <= 64 and revision.isascii() and revision.isprintable()):
        raise InputError(shown_url(conn.engine.url), "downgrade revision",
                         f"expected 'base', -N or a revision below the store's {current or '(none: an empty store)'}, "
                         f"got {shown(revision)}")
    if current is None and revision != "base":
        raise InputError(shown_url(conn.engine.url), "downgrade revision",
                         f"the store has no schema revision yet (an empty or never-migrated store): nothing to "
                         f"downgrade to {shown(revision, 64)}; `flexpipe store upgrade` creates the schema")
    if current is None or revision == current:
        return []
    if revision.startswith("-") and revision[1:].isdigit():  # relative, as `alembic downgrade -1` gives it
        target: str | None = current
        for _ in range(int(revision[1:])):
            target = _script().get_revision(target).down_revision if target else None  # type: ignore[assignment]
        revision = target or "base"
    try:
        steps = list(_script().iterate_revisions(current, revision))
    except (CommandError, RevisionError) as exc:
        why = shown(first_line(exc))
        raise InputError(shown_url(conn.engine.url), "downgrade revision",
                         f"{why}; expected 'base' or a revision below the store's {current}") from None
    losses = []
    for step in steps:
        check: Any = getattr(step.module, "data_lost_by_downgrade", None)
        if check is not None:
            losses += [f"{step.revision} -> {step.down_revision or 'base'}: {what}" for what in check(conn)]
    return losses


def downgrade(engine: Engine, revision: str, *, force: bool = False) -> list[str]:
    """Downgrade the database behind ``engine`` to ``revision`` (``"base"`` drops everything), atomically.

    Returns what was dropped (see :func:`downgrade_losses`).

    Raises:
        InputError: the downgrade would drop data and not ``force`` (every loss named, with the command
            that forces it); ``revision`` is unknown or not below the current revision.
    """
    with migration_transaction(engine) as conn:
        losses = downgrade_losses(conn, revision)
        if losses and not force:
            raise InputError(shown_url(engine.url), f"downgrade to {revision}",
                             f"would drop data: {'; '.join(losses)}; expected --force "
                             f"(`flexpipe store downgrade {revision} --force`) to drop it")
        _alembic(engine, conn, command.downgrade, revision)
    return losses


def repair(engine: Engine, *, force: bool = False) -> dict[str, int]:
    """Repair a half-migrated store: drop its unversioned FlexPipe tables and upgrade to head.

    Returns the dropped tables with their row counts ({} when the store was not half-migrated).

    Raises:
        InputError: those tables hold rows and not ``force``.
    """
    with migration_transaction(engine) as conn:
        found = _unversioned_tables(conn)
        _drop_unversioned(conn, engine, force=force)
        _alembic(engine, conn, command.upgrade, "head")
    return found
