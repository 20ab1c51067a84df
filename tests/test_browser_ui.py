"""The Dagster UI in headless Chromium: a user sees the assets and sensors and runs the profile refresh.

Needs Debian's ``chromium`` (``make test`` installs it when missing and it can) and the Python
``playwright`` package driving that system executable (no browser download).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.support import EXAMPLES, REPO, PortClash, is_port_clash, retry_on_port_clash, unused_port, wait_until

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: Deadlines: ``dagster dev`` answering, a clicked Materialize launching its run, that run finishing.
UI_START_TIMEOUT_S, RUN_LAUNCH_TIMEOUT_S, RUN_FINISH_TIMEOUT_S = 180, 60, 240


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _start_dagster_dev(home, env) -> tuple[subprocess.Popen, str]:
    """``dagster dev`` on a loopback port; the process and its URL once it answers.

    dagster-webserver cannot bind port 0 and report it (``-p 0`` means "3000 or any free one",
    logged but not returned), so the port is guessed, and the start retried when the log says that
    another process took it meanwhile."""

    def attempt() -> tuple[subprocess.Popen, str]:
        port = unused_port()
        log_path = home / f"dagster-dev-{port}.log"
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "dagster"), "dev", "-w",
                                     str(REPO / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
                                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            text = log_path.read_text(errors="replace")
            if is_port_clash(text):
                raise PortClash(f"port {port} taken; log: {log_path}")
            if proc.poll() is not None:
                raise AssertionError(f"dagster dev exited with {proc.returncode} before answering; log: {log_path}")
            if f"Serving dagster-webserver on {url}" not in text:  # not some other server on that port
                return False
            try:
                urllib.request.urlopen(f"{url}/server_info", timeout=2)
            except OSError:
                return False
            return True

        try:
            wait_until(answers, UI_START_TIMEOUT_S, f"dagster dev to answer at {url}/server_info (log: {log_path})",
                       interval_s=1)
        except BaseException:
            _stop(proc)
            raise
        return proc, url

    return retry_on_port_clash(attempt, "dagster dev")


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory):
    """``dagster dev`` (webserver + daemon) on a loopback port, stopped with its whole process group."""
    if CHROMIUM is None:
        pytest.skip("Debian chromium is not installed (apt-get install chromium; make test does it as root)")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    home = tmp_path_factory.mktemp("ui")
    dagster_home = home / "dagster"
    dagster_home.mkdir()
    shutil.copy(REPO / "deploy" / "dagster.yaml", dagster_home / "dagster.yaml")
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "FLEXPIPE_HOME": str(home / "fp"),
           "FLEXPIPE_PROBE": "0", "FLEXPIPE_CLUSTER_FILE": str(EXAMPLES / "fragmented_lab.yaml")}
    env.pop("FLEXPIPE_DATABASE_URL", None)
    proc, url = _start_dagster_dev(home, env)
    try:
        yield url, dagster_home
    finally:
        _stop(proc)


@pytest.fixture
def page(dagster_ui):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 900})
        pg.set_default_timeout(60_000)
        yield pg
        browser.close()


def _skip_dialog(page) -> None:
    skip = page.get_by_role("button", name="Skip", exact=True)  # first-visit community dialog
    if skip.count() and skip.first.is_visible():
        skip.first.click()


def _open(page, url: str) -> None:
    page.goto(url, wait_until="networkidle")
    _skip_dialog(page)


def test_ui_shows_assets_and_sensors_and_runs_profile_refresh(dagster_ui, page):
    from dagster import DagsterInstance, DagsterRunStatus

    from flexpipe_dag.definitions import defs

    url, dagster_home = dagster_ui
    _open(page, f"{url}/assets")
    for key in defs.resolve_all_asset_keys():
        page.get_by_text(key.to_user_string(), exact=True).first.wait_for()
    _open(page, f"{url}/automation")
    for sensor in defs.sensors or []:
        page.get_by_text(sensor.name, exact=True).first.wait_for()
    page.get_by_text("profile_refresh_schedule", exact=True).first.wait_for()

    _open(page, f"{url}/locations/flexpipe/jobs/profile_refresh")
    _skip_dialog(page)
    page.locator("button", has_text=re.compile(r"^\s*Materialize\s*$")).first.click()
    instance = DagsterInstance.from_config(str(dagster_home))
    wait_until(instance.get_runs, RUN_LAUNCH_TIMEOUT_S, "clicking Materialize to launch a run", interval_s=1)
    done = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
    runs = wait_until(lambda: [r for r in instance.get_runs()[:1] if r.status in done], RUN_FINISH_TIMEOUT_S,
                      "the launched run to finish", interval_s=2)
    assert runs[0].job_name == "profile_refresh"
    assert runs[0].status == DagsterRunStatus.SUCCESS, runs[0].status
    _open(page, f"{url}/runs/{runs[0].run_id}")
    page.get_by_text("Success").first.wait_for()
