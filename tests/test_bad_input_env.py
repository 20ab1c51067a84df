"""Bad environment values and store URLs: one clear error naming the variable and what was expected.

The Dagster code location (``flexpipe_dag.definitions``) reads every numeric / boolean knob through
``flexpipe_dag.core.settings.env_value``; a bad value fails the load with an ``InputError``, not a
``ValueError`` traceback from ``float('abc')`` or a pydantic dump.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flexpipe_dag.cli import main as cli_main
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import INT32_MAX, check_number, env_value, parse_setting
from tests.support import EXAMPLES, REPO

#: Every FLEXPIPE_* variable build_resources() parses as a number or boolean.
DEFINITIONS_ENV = ("FLEXPIPE_DWELL_S", "FLEXPIPE_PROBE", "FLEXPIPE_SLO_TTFT_MS", "FLEXPIPE_SLO_TPOT_MS",
                   "FLEXPIPE_MAX_PROMPT_TOKENS", "FLEXPIPE_MAX_NEW_TOKENS", "FLEXPIPE_PLAN_CONCURRENCY",
                   "FLEXPIPE_REFERENCE_REQUESTS", "FLEXPIPE_STAGE_REPLICAS", "FLEXPIPE_PLAN_DTYPE",
                   "FLEXPIPE_PROFILE_REFRESH_CRON", "FLEXPIPE_MODEL", "FLEXPIPE_CONTROL_FILE", "FLEXPIPE_CLUSTER_FILE")


@pytest.fixture
def clean_env(monkeypatch):
    for var in DEFINITIONS_ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# -- the helper ---------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, kind, bounds, needle", [
    ("abc", float, {"ge": 0}, "expected a number >= 0"),
    ("nan", float, {"gt": 0}, "expected a number > 0"),
    ("inf", float, {}, "expected a number"),
    ("3.5", int, {"ge": 1}, "expected an integer >= 1"),
    ("1e3", int, {}, "expected an integer"),
    ("0", int, {"ge": 1}, "expected an integer >= 1"),
    (str(10**30), int, {}, f"<= {2**63 - 1}"),
    ("maybe", bool, {}, "expected a boolean"),
    ("2", bool, {}, "expected a boolean"),
])
def test_parse_setting_refuses_with_source_and_expectation(raw, kind, bounds, needle):
    with pytest.raises(InputError) as e:
        parse_setting(raw, kind, "environment variable FLEXPIPE_X", **bounds)
    assert str(e.value).startswith("environment variable FLEXPIPE_X: ")
    assert needle in str(e.value) and repr(raw)[:20] in str(e.value)


@pytest.mark.parametrize("raw, kind, expected", [
    (" 30 ", int, 30), ("2.5", float, 2.5), ("TRUE", bool, True), ("off", bool, False), ("0", bool, False),
])
def test_parse_setting_accepts_good_values(raw, kind, expected):
    assert parse_setting(raw, kind, "src") == expected


def test_env_value_unset_or_blank_is_the_default(monkeypatch):
    monkeypatch.delenv("FLEXPIPE_UNSET_KNOB", raising=False)
    assert env_value("FLEXPIPE_UNSET_KNOB", float, -1.0, ge=0) == -1.0
    monkeypatch.setenv("FLEXPIPE_UNSET_KNOB", "  ")
    assert env_value("FLEXPIPE_UNSET_KNOB", int, 7) == 7
    monkeypatch.setenv("FLEXPIPE_UNSET_KNOB", "12")
    assert env_value("FLEXPIPE_UNSET_KNOB", int, 7, ge=1) == 12


def test_check_number_names_source_and_field():
    with pytest.raises(InputError, match=r"^cfg\.json: head_dim: expected an integer >= 1, got 0$"):
        check_number(0, "cfg.json", "head_dim", integer=True, ge=1)
    with pytest.raises(InputError, match="got True"):
        check_number(True, None, "--x", integer=True)
    with pytest.raises(InputError, match="got 'abc'"):
        check_number("abc", "cfg.json", "rope_theta", gt=0)
    check_number(float("inf"), None, "--window-s END", gt=0, finite=False)
    check_number(INT32_MAX, None, "--n", integer=True, le=INT32_MAX)


# -- the code location --------------------------------------------------------------------------
@pytest.mark.parametrize("var, value, needle", [
    ("FLEXPIPE_DWELL_S", "abc", "expected a number >= 0 (seconds), got 'abc'"),
    ("FLEXPIPE_DWELL_S", "-5", "expected a number >= 0 (seconds), got '-5'"),
    ("FLEXPIPE_PROBE", "maybe", "expected a boolean"),
    ("FLEXPIPE_STAGE_REPLICAS", "2", "expected a boolean"),
    ("FLEXPIPE_SLO_TTFT_MS", "fast", "expected a number > 0 and <= 3.6e+06 (milliseconds)"),
    ("FLEXPIPE_SLO_TPOT_MS", "0", "expected a number > 0 and <= 3.6e+06 (milliseconds)"),
    ("FLEXPIPE_MAX_PROMPT_TOKENS", "-1", "expected an integer >= 0"),
    ("FLEXPIPE_MAX_NEW_TOKENS", str(10**30), f"<= {INT32_MAX} (tokens)"),
    ("FLEXPIPE_PLAN_CONCURRENCY", "0", "expected an integer >= 1"),
    ("FLEXPIPE_PLAN_CONCURRENCY", "3.5", "expected an integer >= 1"),
    ("FLEXPIPE_REFERENCE_REQUESTS", "10", "expected an integer >= 50"),
    ("FLEXPIPE_PLAN_DTYPE", "fp7", "unknown dtype 'fp7'; expected one of fp32"),
])
def test_build_resources_names_the_bad_variable(var, value, needle, clean_env):
    from flexpipe_dag.definitions import build_resources

    clean_env.setenv(var, value)
    with pytest.raises(InputError) as e:
        build_resources()
    assert str(e.value).startswith(f"environment variable {var}: ") and needle in str(e.value), str(e.value)


def test_build_resources_reads_good_values(clean_env):
    from flexpipe_dag.definitions import build_resources

    for var, value in {"FLEXPIPE_DWELL_S": "30", "FLEXPIPE_PROBE": "false", "FLEXPIPE_STAGE_REPLICAS": "0",
                       "FLEXPIPE_PLAN_CONCURRENCY": " 16 ", "FLEXPIPE_SLO_TTFT_MS": "4000",
                       "FLEXPIPE_PLAN_DTYPE": "fp32", "FLEXPIPE_MAX_NEW_TOKENS": ""}.items():
        clean_env.setenv(var, value)
    res = build_resources()
    assert res["control"].dwell_s == 30.0 and res["prober"].probe is False
    assert res["control"].resolved().controller.dwell_s == 30.0
    planning = res["planning"]
    assert planning.concurrency == 16 and planning.slo_ttft_ms == 4000.0 and planning.stage_replicas is False
    assert planning.dtype == "fp32" and planning.max_new_tokens == 0  # blank = unset = the field's default


def test_build_resources_defaults_without_environment(clean_env):
    from flexpipe_dag.definitions import build_resources

    res = build_resources()
    assert res["control"].dwell_s is None and res["prober"].probe is True
    assert res["control"].resolved().controller.dwell_s == 600.0  # unset: the seed's dwell
    assert res["planning"].concurrency == 32 and res["planning"].stage_replicas is True


def test_bad_cron_names_the_variable(clean_env):
    from flexpipe_dag.jobs.profiling import profile_refresh_crons

    clean_env.setenv("FLEXPIPE_PROFILE_REFRESH_CRON", "every night")
    with pytest.raises(InputError, match="FLEXPIPE_PROFILE_REFRESH_CRON: expected a 5-field cron expression"):
        profile_refresh_crons()
    clean_env.setenv("FLEXPIPE_PROFILE_REFRESH_CRON", "30 3 * * *")
    assert profile_refresh_crons() == ("30 3 * * *",)


def test_in_memory_store_url_fails_the_code_location(clean_env):
    from flexpipe_dag.definitions import build_resources

    clean_env.setenv("FLEXPIPE_DATABASE_URL", "sqlite:///:memory:")
    with pytest.raises(InputError, match="FLEXPIPE_DATABASE_URL: 'sqlite:///:memory:' is an in-memory SQLite"):
        build_resources()


@pytest.mark.parametrize("var, value, needle", [
    ("FLEXPIPE_DWELL_S", "abc", "environment variable FLEXPIPE_DWELL_S: expected a number >= 0 (seconds), got 'abc'"),
    ("FLEXPIPE_SENSOR_INTERVAL_S", "0", "environment variable FLEXPIPE_SENSOR_INTERVAL_S: expected an integer >= 1"),
])
def test_loading_the_code_location_fails_with_one_clear_line(var, value, needle, tmp_path):
    """A fresh interpreter loading the code location, as ``dagster dev`` does: the last line names the variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXPIPE_")}
    env.update({"FLEXPIPE_HOME": str(tmp_path), var: value, "PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, "-c", "import flexpipe_dag.definitions"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"flexpipe_dag.core.errors.InputError: {needle}" or (needle in last and "InputError" in last), last
    assert "ValueError: could not convert" not in proc.stderr and "invalid literal" not in proc.stderr


def test_plan_reads_stage_replicas_through_the_helper(monkeypatch, capsys):
    monkeypatch.setenv("FLEXPIPE_STAGE_REPLICAS", "perhaps")
    assert cli_main(["plan", "--cluster", str(EXAMPLES / "fragmented_lab.yaml"), "--model", "Llama-2-7B"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "FLEXPIPE_STAGE_REPLICAS: expected a boolean" in err, err


# -- the store URL ------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["sqlite:///:memory:", "sqlite://", "sqlite+pysqlite:///:memory:",
                                 "sqlite:///file::memory:?cache=shared",
                                 "sqlite:///file:fp?mode=memory&cache=shared&uri=true"])
def test_in_memory_sqlite_is_refused(url):
    from flexpipe_dag.sql.store import Store, check_store_url

    with pytest.raises(InputError, match="in-memory SQLite database: every process and connection would get"):
        check_store_url(url)
    with pytest.raises(InputError, match="^FLEXPIPE_DATABASE_URL: .*expected a file"):
        Store.from_url(url)


def test_file_sqlite_urls_still_pass(tmp_path):
    from flexpipe_dag.sql.store import check_store_url

    assert check_store_url(f"sqlite:///{tmp_path / 'fp.db'}").endswith("fp.db")
    assert check_store_url("postgresql+psycopg2://u:secret@db:5432/fp") == "postgresql+psycopg2://u:***@db:5432/fp"


def test_in_memory_url_from_environment_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", "sqlite:///:memory:")
    assert cli_main(["profile", "--cluster", str(EXAMPLES / "seed_example.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "FLEXPIPE_DATABASE_URL" in err and "in-memory" in err, err


def test_store_resource_refuses_in_memory_url():
    from flexpipe_dag.resources.store_resource import StoreResource

    with pytest.raises(InputError, match="in-memory"):
        StoreResource(database_url="sqlite://").get_store()


def test_build_resources_refuses_a_bad_control_file_at_load(tmp_path, clean_env):
    from flexpipe_dag.definitions import build_resources

    bad = tmp_path / "control.yaml"
    bad.write_text("controller:\n  rps_ema_alpha: 0\n  device_weight: yes\ntide:\n  horizon_s: .inf\n")
    clean_env.setenv("FLEXPIPE_CONTROL_FILE", str(bad))
    with pytest.raises(InputError) as e:
        build_resources()
    # every bad figure of the section is named, not just the first
    assert str(e.value).startswith(f"{bad}: controller.rps_ema_alpha: ") and "also controller.device_weight" in str(e.value)
    bad.write_text("tide:\n  horizon_s: .inf\n")
    with pytest.raises(InputError, match=r"tide\.horizon_s"):
        build_resources()


def test_demo_gives_dagster_a_persistent_home_when_none_is_set(tmp_path, monkeypatch):
    # `flexpipe demo` run directly (not through make): its jobs run steps in subprocesses, which an
    # ephemeral instance refuses, so DAGSTER_HOME defaults to $FLEXPIPE_HOME/dagster with deploy/dagster.yaml
    from flexpipe_dag.cli.demo import dagster_home

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.setenv("FLEXPIPE_HOME", str(tmp_path))
    home = dagster_home()
    assert home == tmp_path / "dagster" and (home / "dagster.yaml").read_text() == (REPO / "deploy" / "dagster.yaml").read_text()
    import os

    assert os.environ["DAGSTER_HOME"] == str(home)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(mine))
    assert dagster_home() == mine and (mine / "dagster.yaml").read_text() == "telemetry:\n  enabled: false\n"


def test_flexpipe_home_that_is_a_file_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    # a FLEXPIPE_HOME naming a file crashed every store command with a FileExistsError traceback
    home = tmp_path / "home"
    home.write_text("not a directory")
    monkeypatch.setenv("FLEXPIPE_HOME", str(home))
    monkeypatch.delenv("FLEXPIPE_DATABASE_URL", raising=False)
    assert cli_main(["profile", "--cluster", str(EXAMPLES / "fleet_small.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("flexpipe profile: error: environment variable FLEXPIPE_HOME: cannot use ")
    assert str(home) in err and "expected a directory" in err
    assert home.read_text() == "not a directory"


def test_a_corrupt_store_under_flexpipe_home_is_not_blamed_on_flexpipe_database_url(tmp_path, monkeypatch, capsys):
    # with FLEXPIPE_DATABASE_URL unset the store is FLEXPIPE_HOME's SQLite file: the message named the variable
    # the user never set
    (tmp_path / "flexpipe.db").write_bytes(b"this is not an SQLite database" * 100)
    monkeypatch.setenv("FLEXPIPE_HOME", str(tmp_path))
    monkeypatch.delenv("FLEXPIPE_DATABASE_URL", raising=False)
    assert cli_main(["store", "status"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "the store under FLEXPIPE_HOME: cannot open the store at " in err and "FLEXPIPE_DATABASE_URL" not in err
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", f"sqlite:///{tmp_path / 'flexpipe.db'}")  # the same file, named
    assert cli_main(["store", "status"]) == 2
    assert "FLEXPIPE_DATABASE_URL: cannot open the store at " in capsys.readouterr().err
