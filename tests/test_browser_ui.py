"""The Dagster UI in headless Chromium: a user sees the assets and sensors and runs the profile refresh.

Needs Debian's ``chromium`` (``make test`` installs it when missing and it can) and the Python
``playwright`` package driving that system executable (no browser download).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support import EXAMPLES, REPO

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory):
    """``dagster dev`` (webserver + daemon) on a free loopback port, stopped with its whole process group."""
    if CHROMIUM is None:
        pytest.skip("Debian chromium is not installed (apt-get install chromium; make test does it as root)")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    home = tmp_path_factory.mktemp("ui")
    dagster_home = home / "dagster"
    dagster_home.mkdir()
    shutil.copy(REPO / "deploy" / "dagster.yaml", dagster_home / "dagster.yaml")
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "FLEXPIPE_HOME": str(home / "fp"),
           "FLEXPIPE_PROBE": "0", "FLEXPIPE_CLUSTER_FILE": str(EXAMPLES / "fragmented_lab.yaml")}
    env.pop("FLEXPIPE_DATABASE_URL", None)
    log = open(home / "dagster-dev.log", "w")
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "dagster"), "dev", "-w",
                             str(REPO / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/server_info", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"dagster dev did not come up; log: {home / 'dagster-dev.log'}")
                time.sleep(1)
        yield url, dagster_home
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


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
    page.wait_for_timeout(2000)
    instance = DagsterInstance.from_config(str(dagster_home))
    deadline = time.monotonic() + 240
    runs = []
    while time.monotonic() < deadline:
        runs = instance.get_runs()
        if runs and runs[0].status in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED):
            break
        time.sleep(2)
    assert runs, "clicking Materialize launched no run"
    assert runs[0].job_name == "profile_refresh"
    assert runs[0].status == DagsterRunStatus.SUCCESS, runs[0].status
    _open(page, f"{url}/runs/{runs[0].run_id}")
    page.get_by_text("Success").first.wait_for()
