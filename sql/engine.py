"""Engines of the FlexPipe store, and store URLs as messages show them.

SQLite (WAL mode, foreign keys on) under ``FLEXPIPE_HOME`` by default; PostgreSQL when
``FLEXPIPE_DATABASE_URL`` is set. Schema migrations (upgrade, guarded downgrade, repair) live in
:mod:`flexpipe_dag.sql.schema`.

On SQLite, SQLAlchemy (not pysqlite) begins every transaction, so DDL is transactional: pysqlite's
legacy mode would run each ``CREATE TABLE`` outside any transaction and a killed first migration
would leave tables without a schema version. A connection (or an engine made with
``engine.execution_options(**IMMEDIATE)``) carrying :data:`IMMEDIATE` begins with ``BEGIN IMMEDIATE``:
it takes SQLite's write lock first, so a read-then-write transaction (allocating the next version
number) never races another writer and never fails with a stale snapshot.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_plus

from alembic.config import Config
from sqlalchemy import Engine, create_engine, event

from flexpipe_dag.core.errors import InputError, first_line
from flexpipe_dag.core.settings import database_url

_SQL_DIR = Path(__file__).resolve().parent

#: Execution options of a transaction that takes SQLite's write lock when it begins (no-op on PostgreSQL).
IMMEDIATE: dict[str, Any] = {"flexpipe_sqlite_begin": "IMMEDIATE"}

#: How long a SQLite connection waits for another writer's lock before failing, in milliseconds.
SQLITE_BUSY_TIMEOUT_MS = 60_000


def make_engine(url: str | None = None, **engine_kwargs: Any) -> Engine:
    """Create an engine for ``url`` (default: :func:`database_url`), with SQLite set up for WAL and
    transactional DDL (see the module docstring).

    ``engine_kwargs`` go to :func:`sqlalchemy.create_engine` (e.g. ``connect_args``).
    """
    url = url or database_url()
    engine = create_engine(url, **engine_kwargs)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # pragma: no cover - exercised by every SQLite test
            dbapi_conn.isolation_level = None  # pysqlite issues no BEGIN of its own; _sqlite_begin does
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):  # pragma: no cover - exercised by every SQLite test
            mode = conn.get_execution_options().get("flexpipe_sqlite_begin", "DEFERRED")
            conn.exec_driver_sql(f"BEGIN {mode}")
    return engine


def alembic_config(engine: Engine | None = None) -> Config:
    """Alembic config pointing at the packaged migrations (``sql/migrations``)."""
    cfg = Config(str(_SQL_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(_SQL_DIR / "migrations"))
    if engine is not None:
        cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


#: ``scheme://`` then the user-info part up to the *last* ``@`` of the text: a password may hold an unescaped
#: ``@``, ``/``, spaces, tabs or line breaks, and SQLAlchemy lets a user name hold ``@`` (``[^:/]*``).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/]*):(?P<password>.*)@", re.S)
#: ``key=`` of a URL query or a libpq DSN (a secret's value runs to its closing quote when ``'quoted'`` (DSN),
#: else to the next ``&``, so a value holding spaces or line breaks is hidden whole; a DSN's later pairs go too).
_PARAM_KEY = re.compile(r"(?<![\w%.+\-])(?P<key>[\w%.+\-]+)\s*=\s*")
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'?", re.S)
#: A parameter whose name (percent-decoded, any case) ends like this holds a secret: ``password``,
#: ``sslpassword``, ``PassWord``, ``pass%77ord``, ``passwd``, ``pwd``. (``passfile`` names a file: not a secret.)
_SECRET_KEY = re.compile(r"(?:pass(?:word|wd)?|pwd)$", re.I)
MASK = "***"


def _secret_params(text: str) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of the value of every secret parameter (:data:`_SECRET_KEY`) in ``text``."""
    pos = 0
    while (mt := _PARAM_KEY.search(text, pos)) is not None:
        pos = mt.end()
        if _SECRET_KEY.search(unquote_plus(mt["key"]).strip()):
            quoted = _QUOTED.match(text, pos)
            end = quoted.end() if quoted else (text.find("&", pos) % (len(text) + 1))
            yield pos, end
            pos = end


def _mask_params(text: str) -> str:
    out, last = [], 0
    for start, end in _secret_params(text):
        out += [text[last:start], MASK]
        last = end
    return "".join(out) + text[last:]


def masked_url(text: str) -> str:
    """``text`` (a database URL, parsable or not, or a message holding one) with every password shown as ``***``.

    Hides (never under-masks; a later ``@`` or ``&`` in the text may widen what is hidden):

    * the user-info password: from the first ``:`` after the user name up to the last ``@`` of the text, so
      a password holding an unescaped ``@``, ``/``, space, tab or line break is hidden whole;
    * every ``password=`` / ``sslpassword=`` / ``passwd=`` / ``pwd=`` parameter (any case, percent-encoded
      names too) of a query string (``?user=a&password=...``, ``///db?host=h&password=...``) or of a
      libpq DSN a driver echoes (``password='...'``): up to the next ``&`` or the closing quote.
    """
    text = _USERINFO.sub(lambda mt: f"{mt['scheme']}{mt['user']}:{MASK}@", text)
    return _mask_params(text)


def url_secrets(url: str) -> list[str]:
    """The passwords ``url`` carries (user-info and query parameters, raw and percent-decoded), longest first.

    For scrubbing a driver's message, which may echo a password in a form :func:`masked_url` does not
    recognise (a DSN fragment, a quoted value). Empty when there are none.
    """
    found: set[str] = set()
    mt = _USERINFO.search(url)
    if mt:
        found.add(mt["password"])
    for start, end in _secret_params(url):
        found.add(url[start:end].strip("'"))
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url.strip())
        found.add(str(parsed.password or ""))
        for key, value in parsed.query.items():
            if _SECRET_KEY.search(key.strip()):
                found.update((value,) if isinstance(value, str) else value)
    except Exception:  # an unparsable URL: the regular expressions above found what there is
        pass
    found |= {unquote_plus(s) for s in found} | {unquote(s) for s in found}
    return sorted((s for s in found if s and s != MASK), key=len, reverse=True)


def scrubbed(text: str, url: str | None) -> str:
    """``text`` (a driver's message) with the passwords of ``url`` (:func:`url_secrets`) and any URL or DSN
    password in it (:func:`masked_url`) shown as ``***``. A password is masked where it stands alone, not inside
    a longer word: a password ``p`` left "No module named 'psycopg'" as "'***syco***g'"."""
    for secret in url_secrets(url) if url else ():
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", MASK, text)
    return masked_url(text)


def shown_url(url: Any) -> str:
    """A store URL (string or :class:`sqlalchemy.engine.URL`) for messages and logs: passwords hidden (user-info
    and query parameters, see :func:`masked_url`)."""
    if not isinstance(url, str):
        url = url.render_as_string(hide_password=True)
    return masked_url(url.strip())


@contextmanager
def opening_errors(shown: str, url: str | None = None) -> Iterator[None]:
    """Turn a missing driver or a failed connection raised inside into the one-line :class:`InputError`
    naming the store (``shown``: the URL as :func:`shown_url` shows it); the driver's message is scrubbed of
    ``url``'s passwords and of any URL or DSN password (:func:`scrubbed`) before it is cut to its first line.

    Raises:
        InputError: ``FLEXPIPE_DATABASE_URL`` named (or the store under ``FLEXPIPE_HOME``, when the URL is
            that default: :func:`~flexpipe_dag.core.settings.database_url_source`); no driver for the URL's
            dialect, or the database cannot be reached or opened.
    """
    from sqlalchemy.exc import DBAPIError, NoSuchModuleError

    from flexpipe_dag.core.settings import database_url_source

    try:
        yield
    except (NoSuchModuleError, ModuleNotFoundError) as exc:
        raise InputError(database_url_source(url), None, f"no driver for {shown}: {scrubbed(str(exc), url)}; "
                         "use sqlite:/// or postgresql+psycopg2:// (pip install -e .[postgres])") from None
    except DBAPIError as exc:
        reason = first_line(exc, scrubbed(str(exc.orig) if exc.orig else str(exc), url))
        raise InputError(database_url_source(url), None, f"cannot open the store at {shown}: {reason}") from None


def check_store_url(url: str, source: str = "FLEXPIPE_DATABASE_URL") -> str:
    """Check a store URL without connecting; return it for messages (password hidden, see :func:`shown_url`).

    An in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``, ``file::memory:`` or
    ``mode=memory`` URIs) is refused: every process and every pooled connection would get its own
    empty database, so what one Dagster run or stage worker wrote would be invisible to the next and
    vanish on exit.

    Raises:
        InputError: ``source`` named; the URL does not parse (bad port too), holds an unescaped ``@`` in its
            password (the driver would show the rest as a host name), or names an in-memory database. The
            message shows the URL with its password masked.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    shown = shown_url(url)
    try:
        parsed = make_url(url.strip())
    except (ArgumentError, ValueError) as exc:
        raise InputError(source, None,
                         f"{shown!r} is not a database URL ({scrubbed(str(exc), url)}); expected e.g. "
                         "sqlite:///path/flexpipe.db or postgresql+psycopg2://user@host:5432/db") from None
    if "@" in (parsed.host or ""):
        raise InputError(source, None,
                         f"{shown!r} holds an unescaped '@' in its user name or password; expected it "
                         "percent-encoded as %40 (e.g. postgresql+psycopg2://user:p%40ss@host:5432/db)")
    if parsed.get_backend_name() == "sqlite":
        database = (parsed.database or "").strip()
        mode = parsed.query.get("mode")
        modes = (mode,) if isinstance(mode, str) else tuple(mode or ())
        if database in ("", ":memory:") or database.startswith("file::memory:") or "memory" in modes \
                or "mode=memory" in database:
            raise InputError(source, None,
                             f"{shown!r} is an in-memory SQLite database: every process and connection would get "
                             "its own empty store and results would vanish; expected a file, e.g. "
                             "sqlite:////abs/path/flexpipe.db (or leave FLEXPIPE_DATABASE_URL unset for "
                             "$FLEXPIPE_HOME/flexpipe.db)")
    return shown


def missing_sqlite_file(url: str) -> Path | None:
    """The database file a SQLite ``url`` names when it does not exist yet (opening it would create it), else None
    (another database, a ``file:`` URI, or a file that exists)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url.strip())
    except Exception:  # check_store_url names what is wrong with it
        return None
    database = (parsed.database or "").strip()
    if parsed.get_backend_name() != "sqlite" or not database or database.startswith("file:") \
            or database == ":memory:":
        return None
    path = Path(database)
    return None if path.exists() else path
