"""Attacks on the store (issue #15): crashes, races, downgrades, half-migrated files and leaked secrets.

* a process SIGKILLed at random points of a first open (a migration) or of a profile write leaves a
  store that opens and holds no partial version;
* parallel writers (processes) each get their own profile version, on SQLite and PostgreSQL; two
  processes opening a fresh store at once both succeed;
* a downgrade that would drop data refuses without force and names what it drops; an old store
  opened without migrating names the command that upgrades it; a half-migrated store is repaired
  (empty) or named with the command that repairs it (rows);
* the database URL reaches Dagster by name (``EnvVar``), so no snapshot holds its password, and a
  malformed URL holding a password is printed masked.

Child processes are forked (the parent has imported everything already), so each starts in
milliseconds and a kill lands inside the store code, not inside Python's start-up.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, inspect, select, text

from flexpipe_dag.cli import main as cli_main
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.store import Store, current_revision, downgrade, head_revisions, make_engine, repair
from tests.support import REPO

FORK = multiprocessing.get_context("fork")
PASSWORD = "s3cr3t-Pa55"


# -- child processes ---------------------------------------------------------------------------------
def _engine_args(engine) -> tuple[str, dict]:
    """URL (password kept) and connect args that reach the same database (and PostgreSQL schema) as ``engine``."""
    url = engine.url.render_as_string(hide_password=False)
    if engine.dialect.name != "postgresql":
        return url, {}
    with engine.connect() as conn:
        schema = conn.scalar(text("select current_schema()"))
    return url, {"options": f"-csearch_path={schema}"}


def _open_fresh_stores_forever(directory: str) -> None:
    """Open one fresh SQLite store after another (each open is a first migration) until killed."""
    for i in range(10**6):
        engine = make_engine(f"sqlite:///{directory}/s{i:04d}.db")
        Store(engine)
        engine.dispose()


def _save_profiles_forever(url: str, profile, writing=None) -> None:
    store = Store(make_engine(url))
    if writing is not None:
        writing.set()  # the store is open: from here on a kill lands in a profile write
    while True:
        store.save_profile(profile)


def _save_profiles(url: str, connect_args: dict, profile, count: int, start) -> None:
    start.wait(30)
    store = Store(make_engine(url, connect_args=connect_args))
    for _ in range(count):
        store.save_profile(profile)


def _open_store(url: str, connect_args: dict, start) -> None:
    start.wait(30)
    Store(make_engine(url, connect_args=connect_args))


def _run_all(targets: list[tuple]) -> None:
    """Run each ``(function, args)`` in its own forked process at once; every one must exit 0 within 120 s."""
    procs = [FORK.Process(target=fn, args=args) for fn, args in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert codes == [0] * len(procs), f"child exit codes {codes} (None: hung)"


def _kill_after(target, args, delay_s: float, started=None) -> None:
    """Run ``target(*args)`` in a forked child and SIGKILL it ``delay_s`` after it starts, or after it sets
    the event ``started`` when one is given (so the kill lands in what follows, however slow the host)."""
    proc = FORK.Process(target=target, args=args)
    proc.start()
    if started is not None:
        assert started.wait(60), "the child never got ready"
    time.sleep(delay_s)
    proc.kill()  # SIGKILL: no cleanup, no rollback by the child
    proc.join(10)
    assert proc.exitcode is not None, "the killed child did not die"


def _assert_whole_versions(store: Store, profile) -> list[int]:
    """Every stored version of ``profile``'s cluster is whole (all device, link and host rows); returns the versions."""
    with store.session() as s:
        devices, links, hosts = (dict(s.execute(select(row.profile_version_id, func.count()).group_by(
            row.profile_version_id)).all()) for row in (m.DeviceRow, m.LinkRow, m.HostRow))
    infos = store.list_profile_versions(profile.cluster_id)
    whole = (len(profile.devices), len(profile.links), len(profile.topology.hosts) if profile.topology else 0)
    for info in infos:
        assert (devices.get(info.id, 0), links.get(info.id, 0), hosts.get(info.id, 0)) == whole, info
    return [info.version for info in infos]


# -- crashes -----------------------------------------------------------------------------------------
def test_sigkill_during_first_open_and_profile_writes_leaves_a_store_that_opens(tmp_path, lab_profile):
    """50 SIGKILLs at random points: 25 during first opens (migrations), 25 during profile writes."""
    rng = random.Random(15)
    (head,) = head_revisions()
    t0 = time.perf_counter()
    Store(make_engine(f"sqlite:///{tmp_path / 'timing.db'}"))
    first_open_s = time.perf_counter() - t0
    t_start = time.perf_counter()
    for round_ in range(25):
        directory = tmp_path / f"open{round_}"
        directory.mkdir()
        _kill_after(_open_fresh_stores_forever, (str(directory),), rng.uniform(0, 2.5 * first_open_s))
        for db in sorted(directory.glob("*.db")):
            engine = make_engine(f"sqlite:///{db}")
            left = set(inspect(engine).get_table_names()) & set(m.Base.metadata.tables)
            rev = current_revision(engine)
            assert (rev, left) == (None, set()) or (rev, left) == (head, set(m.Base.metadata.tables)), \
                f"{db}: a killed first migration left revision {rev} with tables {sorted(left)}"
            Store(engine)  # opens without error
            assert current_revision(engine) == head, db
            engine.dispose()

    print(f"25 killed first opens (first open {first_open_s * 1000:.0f} ms) checked in "
          f"{time.perf_counter() - t_start:.1f} s")
    url = f"sqlite:///{tmp_path / 'writes.db'}"
    store = Store(make_engine(url))
    t0 = time.perf_counter()
    store.save_profile(lab_profile)
    write_s = time.perf_counter() - t0
    for _ in range(25):
        writing = FORK.Event()
        _kill_after(_save_profiles_forever, (url, lab_profile, writing), rng.uniform(0, 8 * write_s), writing)
        versions = _assert_whole_versions(Store(make_engine(url)), lab_profile)
        assert versions == list(range(1, len(versions) + 1))  # no gap, no duplicate, no partial version
    assert len(versions) > 25, "the kills should have let some writes through"
    print(f"25 killed profile writers (one write {write_s * 1000:.0f} ms) left {len(versions)} whole versions")


# -- races -------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_engine(request, tmp_path):
    """An engine on a store nothing has opened yet: a new SQLite file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'fresh.db'}")
        yield engine
        engine.dispose()
    else:
        yield request.getfixturevalue("postgres_engine")


BOTH = pytest.mark.parametrize("fresh_engine", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
                               indirect=True)


@BOTH
def test_parallel_writers_store_every_version(fresh_engine, lab_profile):
    """4 processes x 20 profiles of one cluster on a fresh store: versions 1..80, each whole."""
    url, connect_args = _engine_args(fresh_engine)
    start = FORK.Event()
    procs = [(_save_profiles, (url, connect_args, lab_profile, 20, start)) for _ in range(4)]
    start.set()
    _run_all(procs)
    versions = _assert_whole_versions(Store(fresh_engine), lab_profile)
    assert sorted(versions) == list(range(1, 81))


@BOTH
def test_processes_opening_a_fresh_store_at_once_all_succeed(fresh_engine):
    url, connect_args = _engine_args(fresh_engine)
    start = FORK.Event()
    procs = [(_open_store, (url, connect_args, start)) for _ in range(4)]
    start.set()
    _run_all(procs)
    assert current_revision(fresh_engine) == head_revisions()[0]


def test_parallel_calibrations_and_gear_plans_get_their_own_versions(engine, lab_profile):
    """Threads (each on its own connection) saving calibrations and gear plans of one profile version at once:
    distinct, gapless versions on SQLite and PostgreSQL."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from tests.support import enveloped_gear

    store = Store(engine)
    pv = store.save_profile(lab_profile).id
    model_id = store.save_model("SmolLM2-135M", "fp16", 30, {"layers": 30})
    calibration = SimpleNamespace(model_name="SmolLM2-135M", dtype="fp16", num_observations=3,
                                  changed_devices=lambda: [], summary_lines=lambda: [], to_dict=lambda: {})
    with ThreadPoolExecutor(4) as pool:
        cal_versions = list(pool.map(lambda _: store.save_calibration(pv, calibration)[1], range(12)))
        list(pool.map(lambda i: store.save_gears([enveloped_gear(f"g{i}", "balanced", 0, 1, 1)], pv, model_id), range(12)))
    assert sorted(cal_versions) == list(range(1, 13))
    with store.session() as s:
        plan_versions = sorted(s.scalars(select(m.GearRow.plan_version)))
    assert plan_versions == list(range(1, 13))


# -- downgrades, old and half-migrated stores --------------------------------------------------------
def test_downgrade_that_drops_data_refuses_without_force_and_names_it(store, lab_profile):
    from tests.support import enveloped_gear

    engine = store.engine
    (head,) = head_revisions()
    pv = store.save_profile(lab_profile).id
    model_id = store.save_model("SmolLM2-135M", "fp16", 30, {"layers": 30})
    store.save_gears([enveloped_gear("old", "balanced", 0, 1, 1)], pv, model_id)
    store.save_gears([enveloped_gear("new", "balanced", 0, 1, 1)], pv, model_id)  # supersedes "old"
    store.get_or_create_job("j1", config={"trace": "azure-conv"})
    bf16 = sum(d.bf16 is not None for d in lab_profile.devices)
    assert bf16 > 0
    hosts = len(lab_profile.topology.hosts)
    with pytest.raises(InputError, match=rf"downgrade to 0003: would drop data: 0012 -> 0011: the topology of stored "
                                         rf"profiles \({hosts} hosts and their network tiers; their device pairs "
                                         rf"would have no link\); 0007 -> 0006: devices.bf16, the bf16 "
                                         rf"support measured for {bf16} devices; 0004 -> 0003: gears.plan_version: "
                                         r"1 gears of superseded plans would count as current again; expected --force"):
        downgrade(engine, "0003")
    with pytest.raises(InputError) as refused:
        downgrade(engine, "base")
    message = str(refused.value)
    assert "\n" not in message and "flexpipe store downgrade base --force" in message
    for loss in ("0002 -> 0001: inference_jobs.config, the run configs of 1 jobs", "table clusters (1 rows)",
                 f"table devices ({len(lab_profile.devices)} rows)", "table gears (2 rows)"):
        assert loss in message
    assert current_revision(engine) == head and len(store.load_gears(pv, model_id)) == 1  # nothing happened
    assert downgrade(engine, "0004", force=True) == [
        f"0012 -> 0011: the topology of stored profiles ({hosts} hosts and their network tiers; their device pairs "
        f"would have no link)", f"0007 -> 0006: devices.bf16, the bf16 support measured for {bf16} devices"]
    assert current_revision(engine) == "0004"


def test_lossless_downgrade_needs_no_force(store):
    assert downgrade(store.engine, "0004") == []
    assert current_revision(store.engine) == "0004"


def test_cli_downgrade_refuses_then_forces(tmp_path, monkeypatch, capsys, lab_profile):
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    Store.from_url().save_profile(lab_profile)
    assert cli_main(["store", "downgrade", "base"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "would drop data" in err and "table clusters (1 rows)" in err, err
    assert cli_main(["store", "downgrade", "base", "--force"]) == 0
    out = capsys.readouterr().out
    assert "dropped 0001 -> base: table clusters (1 rows)" in out and "schema revision none" in out, out
    assert cli_main(["store", "upgrade"]) == 0
    assert f"schema revision {head_revisions()[0]}" in capsys.readouterr().out


def test_cli_downgrade_to_an_empty_or_huge_revision_is_one_short_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", f"sqlite:///{tmp_path / 'odd.db'}")
    assert cli_main(["store", "downgrade", "0006"]) == 2  # a store with no schema yet: said so, not "a newer FlexPipe"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no schema revision yet" in err and "store upgrade" in err, err
    assert cli_main(["store", "upgrade"]) == 0
    capsys.readouterr()
    for revision in ("", "x" * 5000, "zzz", "a\x1b[31m"):
        assert cli_main(["store", "downgrade", revision]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 600, err[:700]
        assert err.isprintable() or err[:-1].isprintable(), err
    assert cli_main(["store", "status"]) == 0
    assert f"schema revision {head_revisions()[0]}" in capsys.readouterr().out  # nothing changed


def test_alembic_command_line_downgrade_refuses_without_force(tmp_path, lab_profile):
    url = f"sqlite:///{tmp_path / 'alembic.db'}"
    engine = make_engine(url)
    Store(engine).save_profile(lab_profile)
    alembic = [os.path.join(os.path.dirname(sys.executable), "alembic"), "-c", str(REPO / "sql" / "alembic.ini")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLEXPIPE_DATABASE_URL": url}
    run = subprocess.run([*alembic, "downgrade", "0006"], env=env, capture_output=True, text=True, timeout=120)
    said = run.stdout + run.stderr  # alembic prints FAILED: ... on stdout
    assert run.returncode != 0 and "downgrade to 0006 would drop data: 0012 -> 0011: the topology" in said, said
    assert "0007 -> 0006: devices.bf16" in said, said
    assert current_revision(engine) == head_revisions()[0]
    run = subprocess.run([*alembic, "-x", "force=1", "downgrade", "0006"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert current_revision(engine) == "0006"


def test_old_store_opened_without_migrating_names_the_upgrade_command(sqlite_engine):
    Store(sqlite_engine)
    downgrade(sqlite_engine, "0003")
    with pytest.raises(InputError, match=r"schema revision: the store is at schema revision 0003; expected "
                                         r"\d+: run `flexpipe store upgrade`"):
        Store(sqlite_engine, auto_migrate=False)
    Store(sqlite_engine)  # auto-migration upgrades it
    Store(sqlite_engine, auto_migrate=False)


def test_store_from_a_newer_flexpipe_is_named(sqlite_engine):
    Store(sqlite_engine)
    with sqlite_engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(InputError, match="9999.*newer FlexPipe"):
        Store(sqlite_engine, auto_migrate=False)
    with pytest.raises(InputError, match="9999"):
        Store(sqlite_engine)


def _half_migrated(engine, with_rows: bool) -> None:
    """What a killed first migration of an older FlexPipe left: the tables, an empty alembic_version."""
    m.Base.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)"))
        if with_rows:
            conn.execute(text("INSERT INTO clusters (cluster_key, created_at) VALUES ('lab', '2026-01-01')"))


def test_half_migrated_empty_store_is_repaired_on_open(sqlite_engine, lab_profile):
    _half_migrated(sqlite_engine, with_rows=False)
    store = Store(sqlite_engine)
    assert current_revision(sqlite_engine) == head_revisions()[0]
    assert store.save_profile(lab_profile).version == 1


def test_half_migrated_store_with_rows_names_the_repair_command(sqlite_engine):
    _half_migrated(sqlite_engine, with_rows=True)
    with pytest.raises(InputError, match=r"alembic_version: the store holds FlexPipe tables but no schema version .*"
                                         r"clusters \(1 rows\) hold data.*`flexpipe store repair --force`"):
        Store(sqlite_engine)
    with pytest.raises(InputError, match="clusters"):
        repair(sqlite_engine)
    assert repair(sqlite_engine, force=True)["clusters"] == 1
    assert Store(sqlite_engine).list_profile_versions() == []


# -- secrets -----------------------------------------------------------------------------------------
def test_dagster_definitions_hold_the_database_url_by_name_only():
    """Load the code location with a password in FLEXPIPE_DATABASE_URL: the store resource is an EnvVar and the
    repository snapshot Dagster stores for every run (every job, every resource default) holds no password."""
    probe = (
        "import flexpipe_dag.definitions as d\n"
        "from dagster import EnvVar\n"
        "from dagster._core.remote_representation.external_data import RepositorySnap\n"
        "from dagster._serdes import serialize_value\n"
        "store = d.build_resources()['store']\n"
        "assert isinstance(store.database_url, EnvVar), repr(store.database_url)\n"
        "print(repr(store), serialize_value(RepositorySnap.from_def(d.defs.get_repository_def())))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "FLEXPIPE_DATABASE_URL": f"postgresql+psycopg2://fp:{PASSWORD}@127.0.0.1:1/fp"}
    run = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("StoreResource(database_url='FLEXPIPE_DATABASE_URL')")
    # Dagster records the store resource as a consumer of the variable: read by name at run time
    assert '"FLEXPIPE_DATABASE_URL": [{"__class__": "EnvVarConsumer", "name": "store"' in run.stdout
    assert PASSWORD not in run.stdout + run.stderr


@pytest.mark.parametrize("url", [
    f"postgresql+psycopg2://fp:{PASSWORD}@db:notaport/fp",  # does not parse (bad port)
    f"postgresql+psycopg2://fp:{PASSWORD}@127.0.0.1:1/fp",  # parses, cannot connect
    f"postgresql+psycopg2://fp:p@ss{PASSWORD}@127.0.0.1:1/fp",  # an unescaped @ inside the password
    f"mysql://fp:{PASSWORD}@db/fp",  # no driver
])
@pytest.mark.parametrize("command", [
    ["store", "status"],
    ["profile", "--cluster", str(REPO / "examples" / "clusters" / "seed_example.yaml")],  # stores what it read
])
def test_cli_error_masks_the_password(url, command, monkeypatch, capsys):
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", url)
    assert cli_main(command) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and "FLEXPIPE_DATABASE_URL" in err and "fp:***@" in err, err
    assert PASSWORD not in err + captured.out and "ss" + PASSWORD not in err


@pytest.mark.parametrize("url, shown", [
    (f"postgresql+psycopg2://fp:{PASSWORD}@db:notaport/fp", "postgresql+psycopg2://fp:***@db:notaport/fp"),
    (f"postgresql+psycopg2://fp@db:notaport/fp?sslmode=require&password={PASSWORD}",
     "postgresql+psycopg2://fp@db:notaport/fp?sslmode=require&password=***"),
])
def test_dagster_validate_masks_a_malformed_url(url, shown):
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLEXPIPE_DATABASE_URL": url}
    dagster = os.path.join(os.path.dirname(sys.executable), "dagster")
    run = subprocess.run([dagster, "definitions", "validate", "-m", "flexpipe_dag.definitions"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode != 0
    assert shown in run.stdout + run.stderr
    assert PASSWORD not in run.stdout + run.stderr


# every URL form psycopg2 takes a password in (issue #15 attack review): user-info with spaces or a tab,
# query parameters in any case or percent-encoded, a URL without a host
@pytest.mark.parametrize("url, shown", [
    (f"postgresql+psycopg2://alice@127.0.0.1:1/db?password={PASSWORD}", "alice@127.0.0.1:1/db?password=***"),
    (f"postgresql+psycopg2://127.0.0.1:1/db?user=alice&password={PASSWORD}&connect_timeout=5",
     "127.0.0.1:1/db?user=alice&password=***&connect_timeout=5"),
    (f"postgresql+psycopg2:///db?host=127.0.0.1&port=1&password={PASSWORD}", "///db?host=127.0.0.1&port=1&password=***"),
    (f"postgresql+psycopg2:///db?host=127.0.0.1&port=1&PassWord={PASSWORD}", "&PassWord=***"),
    (f"postgresql+psycopg2:///db?host=127.0.0.1&port=1&pass%77ord={PASSWORD}", "&pass%77ord=***"),
    (f"postgresql+psycopg2:///db?host=127.0.0.1&port=1&sslpassword={PASSWORD}&passfile=/tmp/pgpass",
     "&sslpassword=***&passfile=/tmp/pgpass"),
    (f"postgresql+psycopg2://alice:pa ss {PASSWORD}@127.0.0.1:1/db", "//alice:***@127.0.0.1:1/db"),
    (f"postgresql+psycopg2://alice:pa\t{PASSWORD}@127.0.0.1:1/db", "//alice:***@127.0.0.1:1/db"),
    (f"postgresql+psycopg2://al ice:{PASSWORD}@127.0.0.1:1/db", "//al ice:***@127.0.0.1:1/db"),
    (f"postgresql+psycopg2://127.0.0.1:1/db?user=alice&password={PASSWORD}&bogus=1", "&password=***&bogus=1"),
])
def test_cli_masks_every_password_form(url, shown, monkeypatch, capsys):
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", url)
    assert cli_main(["store", "status"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and "FLEXPIPE_DATABASE_URL" in err and shown in err, err
    assert PASSWORD not in err + captured.out and PASSWORD[:-1] not in err, err


def test_shown_url_masks_query_passwords_of_an_engine_url():
    """Messages built from ``engine.url`` (schema errors, logs) hide a query-string password too."""
    from sqlalchemy.engine import make_url

    from flexpipe_dag.sql.engine import shown_url

    url = make_url(f"postgresql+psycopg2://fp:{PASSWORD}@db/fp?sslpassword={PASSWORD}x&application_name=fp")
    assert shown_url(url) == "postgresql+psycopg2://fp:***@db/fp?application_name=fp&sslpassword=***"  # keys sorted


@pytest.mark.parametrize("driver_text", [
    f'invalid dsn: missing "=" after "{PASSWORD}" in connection info string',  # a bare fragment of the DSN
    f"could not connect: user=fp password='{PASSWORD}' host=db",  # the DSN itself, quoted
    f"could not connect: user=fp password={PASSWORD} host=db",
    f"could not connect to postgresql://fp:{PASSWORD}@db/fp",
    f"could not connect: {PASSWORD.replace('-', '%2D')}",  # percent-encoded as it was written
])
def test_driver_messages_are_scrubbed_of_the_password(driver_text):
    from sqlalchemy.exc import OperationalError

    from flexpipe_dag.sql.engine import opening_errors

    url = f"postgresql+psycopg2://fp@db/fp?password={PASSWORD.replace('-', '%2D')}"
    with pytest.raises(InputError) as err, opening_errors("shown", url):
        raise OperationalError("connect", {}, Exception(driver_text + "\nsecond line"))
    message = str(err.value)
    assert message.startswith("FLEXPIPE_DATABASE_URL: cannot open the store at shown: ") and "***" in message
    assert PASSWORD not in message and "5" + PASSWORD[-1] not in message and "\n" not in message, message


def test_a_password_holding_a_line_break_is_masked_whole():
    from flexpipe_dag.sql.engine import masked_url, url_secrets

    url = f"postgresql+psycopg2://fp:{PASSWORD[:4]}\n{PASSWORD[4:]}@db/fp"
    assert masked_url(url) == "postgresql+psycopg2://fp:***@db/fp"
    assert f"{PASSWORD[:4]}\n{PASSWORD[4:]}" in url_secrets(url)


def test_a_short_password_is_masked_where_it_stands_not_inside_words():
    """A password ``p`` turned "No module named 'psycopg'" into "'***syco***g'"."""
    from flexpipe_dag.sql.engine import scrubbed

    url = "postgresql://u:p@127.0.0.1:1/x"
    assert scrubbed("No module named 'psycopg'", url) == "No module named 'psycopg'"
    assert scrubbed("the secret is p.", url) == "the secret is ***."
    assert scrubbed("dsn 'p'", url) == "dsn '***'"
