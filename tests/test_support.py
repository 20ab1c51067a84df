"""The tests' own waiting and port helpers (tests/support.py): deadlines, messages, fast failure."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.support import BackgroundThread, PortClash, hold_unused_port, join_or_fail, retry_on_port_clash, wait_until


def test_wait_until_returns_the_value_or_fails_with_what_it_waited_for():
    box = []
    threading.Timer(0.05, lambda: box.append("x")).start()
    assert wait_until(lambda: box, 5, "the timer") == ["x"]
    with pytest.raises(AssertionError, match=r"timed out after 0\.2 s waiting for nothing at all"):
        wait_until(lambda: False, 0.2, "nothing at all")


def test_a_dead_background_thread_fails_the_wait_at_once_with_its_error():
    def boom():
        raise RuntimeError("submit failed")

    t = BackgroundThread(boom, name="load")
    t.start()
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="thread 'load' died while waiting for 4 submissions: "
                                             "RuntimeError: submit failed") as err:
        wait_until(lambda: False, 60, "4 submissions", thread=t)
    assert time.monotonic() - t0 < 10 and isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(AssertionError, match="submit failed"):
        t.join_or_fail(5)


def test_join_or_fail_names_the_thread_that_did_not_finish():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="stuck", daemon=True)
    t.start()
    with pytest.raises(AssertionError, match=r"timed out after 0\.1 s waiting for thread 'stuck' to finish"):
        join_or_fail(t, 0.1)
    stop.set()
    join_or_fail(t, 5)


def test_held_port_refuses_connections():
    with hold_unused_port() as port, pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_retry_on_port_clash_retries_then_says_why_it_gave_up():
    tries = []

    def attempt():
        tries.append(1)
        if len(tries) < 2:
            raise PortClash("port 1234 taken")
        return "up"

    assert retry_on_port_clash(attempt, "server") == "up" and len(tries) == 2

    def always():
        raise PortClash("port 1234 taken")

    with pytest.raises(AssertionError, match="server: the port picked was taken .* 3 times .*EADDRINUSE"):
        retry_on_port_clash(always, "server")
