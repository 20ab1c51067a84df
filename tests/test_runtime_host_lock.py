"""One pipeline runtime per host: the OS file lock the runtime ops hold (flexpipe_dag/runtime/host_lock.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flexpipe_dag.runtime.host_lock import LOCK_ENV, hold_runtime_lock, runtime_lock_path

#: A process that takes the lock as OWNER, says so on stdout, then holds it until stdin closes.
HOLDER = """
import sys
from flexpipe_dag.runtime.host_lock import hold_runtime_lock
with hold_runtime_lock("Dagster run feedbeef (serve)", print):
    print("held", flush=True)
    sys.stdin.read()
"""


def _start_holder(env=None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env or os.environ.copy())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_free_lock_is_taken_at_once_and_names_its_holder_until_released():
    lock = runtime_lock_path()
    waits: list[str] = []
    with hold_runtime_lock("Dagster run 0123abcd (run_batch)", waits.append) as waited_s:
        assert waited_s == 0.0 and waits == []
        holder = json.loads(lock.with_name(lock.name + ".holder").read_text())
        assert holder["owner"] == "Dagster run 0123abcd (run_batch)" and holder["pid"] == os.getpid()
    assert not lock.with_name(lock.name + ".holder").exists()
    with hold_runtime_lock("again", waits.append) as waited_s:  # released: free again
        assert waited_s == 0.0 and waits == []


def test_a_second_runtime_waits_naming_the_holder_and_starts_when_it_ends():
    holder = _start_holder()
    waits: list[str] = []
    try:
        def on_wait(line: str) -> None:
            waits.append(line)
            if len(waits) == 2:
                holder.stdin.close()  # the first runtime ends after the second has been told twice

        with hold_runtime_lock("second", on_wait, report_every_s=0.5) as waited_s:
            assert holder.wait(timeout=30) == 0
            assert waited_s > 0.4
    finally:
        holder.kill()
    assert len(waits) == 2
    assert "lock" in waits[0] and "held by Dagster run feedbeef (serve) (pid" in waits[0]
    assert "s so far)" in waits[1]  # the repeat report says how long it has waited


def test_a_killed_holder_never_keeps_the_runtime(tmp_path):
    path = tmp_path / "host-wide" / "pipeline_runtime.lock"
    env = {**os.environ, LOCK_ENV: str(path)}
    holder = _start_holder(env)
    os.kill(holder.pid, signal.SIGKILL)  # no finally, no atexit: the kernel drops its flock
    holder.wait(timeout=30)
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LOCK_ENV, str(path))
        assert runtime_lock_path() == path
        with hold_runtime_lock("after the kill", lambda line: None):
            assert json.loads(path.with_name(path.name + ".holder").read_text())["owner"] == "after the kill"
    assert time.monotonic() - t0 < 10


def test_the_lock_is_released_when_the_runtime_fails():
    with pytest.raises(RuntimeError, match="stage 1 crashed"):
        with hold_runtime_lock("failing run", lambda line: None):
            raise RuntimeError("stage 1 crashed")
    holder = _start_holder()  # another process takes it at once
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0
