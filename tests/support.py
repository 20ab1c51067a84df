"""Helpers shared by the test modules (import as ``from tests.support import ...``; conftest.py
holds only fixtures).

* paths and settings: :data:`REPO`, :data:`EXAMPLES`, :data:`PG_URL`, :data:`MODEL_CACHE`;
* waiting: :func:`wait_until` (every wait has a deadline and says what it waited for),
  :class:`BackgroundThread` (a helper thread whose death fails the waiting test at once, with its
  error), :func:`join_or_fail` (a join with a deadline);
* ports: :func:`hold_unused_port` (a port nothing listens on, held for the test), and
  :func:`retry_on_port_clash` for the few product paths that must be handed a port number
  (launchers, ``dagster dev``, the Dagster job's ``control_address``) instead of binding port 0
  themselves and reporting it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "clusters"
#: Data bundled with the package (traces, models, profiling slices): tests read only these.
DATA = REPO / "flexpipe_dag" / "data"
#: The local PostgreSQL server's test database (trust auth). Override with FLEXPIPE_TEST_PG_URL.
PG_URL = os.environ.get("FLEXPIPE_TEST_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
#: Converted model checkpoints are shared by all tests of a machine (converting the GGUF takes ~20 s).
MODEL_CACHE = os.environ.get("FLEXPIPE_TEST_MODEL_CACHE") or os.path.join(
    tempfile.gettempdir(), f"flexpipe-test-cache-{os.getuid()}", "models")

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, *, interval_s: float = 0.05,
               thread: BackgroundThread | None = None) -> T:
    """Poll ``predicate()`` until it returns something truthy, and return that.

    Args:
        predicate: checked at once, then every ``interval_s``.
        timeout_s: deadline for the whole wait.
        what: the awaited condition, for the failure message.
        thread: a background thread the condition depends on: if it has died, fail at once with
            its error instead of waiting out the deadline.

    Raises:
        AssertionError: ``"timed out after {timeout_s} s waiting for {what}"``, or the thread died.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if thread is not None:
            thread.check(what)
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class BackgroundThread(threading.Thread):
    """A daemon thread that keeps the exception it died of, so a test waiting on its work fails fast
    with that error (:meth:`check`, ``wait_until(..., thread=...)``) instead of hanging."""

    def __init__(self, target: Callable[[], object], name: str):
        super().__init__(target=target, name=name, daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:
            self.error = exc

    def check(self, what: str = "its work") -> None:
        """Raise if the thread died of an exception (or ended) while ``what`` was still awaited."""
        if self.error is not None:
            raise AssertionError(f"thread {self.name!r} died while waiting for {what}: "
                                 f"{type(self.error).__name__}: {self.error}") from self.error
        if not self.is_alive() and self.ident is not None:
            raise AssertionError(f"thread {self.name!r} ended while waiting for {what}")

    def join_or_fail(self, timeout_s: float) -> None:
        """Join within ``timeout_s``; re-raise the thread's error if it had one."""
        join_or_fail(self, timeout_s)
        if self.error is not None:
            raise AssertionError(f"thread {self.name!r} failed: {type(self.error).__name__}: {self.error}") \
                from self.error


def join_or_fail(thread: threading.Thread, timeout_s: float) -> None:
    """``thread.join(timeout_s)``, failing the test if the thread is still running after it."""
    thread.join(timeout=timeout_s)
    if thread.is_alive():
        raise AssertionError(f"timed out after {timeout_s} s waiting for thread {thread.name!r} to finish")


@contextlib.contextmanager
def hold_unused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A TCP port on ``host`` that is bound (so nobody else can take it) but not listening, for as
    long as the ``with`` block runs: a connection to it is refused, reliably."""
    with socket.socket() as s:
        s.bind((host, 0))
        yield s.getsockname()[1]


def unused_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Racy by nature: only for product paths that must be handed
    a number before anything binds it (wrap the attempt in :func:`retry_on_port_clash`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: Texts by which the product, torch, uvicorn and the OS say that a port was already taken.
PORT_CLASH_MARKERS = ("address already in use", "eaddrinuse", "errno 98", "cannot serve the control store on port")


def is_port_clash(text: str) -> bool:
    """Whether ``text`` (an error, a log) says that a port was already taken."""
    low = str(text).lower()
    return any(m in low for m in PORT_CLASH_MARKERS)


class PortClash(Exception):
    """Raised by an attempt of :func:`retry_on_port_clash` whose guessed port was taken meanwhile."""


def retry_on_port_clash(attempt: Callable[[], T], what: str, attempts: int = 3) -> T:
    """Run ``attempt()`` (which picks its own ports with :func:`unused_port`) until it does not raise
    :class:`PortClash`, at most ``attempts`` times.

    Raises:
        AssertionError: every attempt found its port taken (names ``what`` and the last clash).
    """
    last: PortClash | None = None
    for _ in range(attempts):
        try:
            return attempt()
        except PortClash as exc:
            last = exc
    raise AssertionError(f"{what}: the port picked was taken by another process {attempts} times in a row "
                         f"(EADDRINUSE); last: {last}")


def enveloped_gear(gear_id: str, kind: str, rps_min: float, rps_max: float, stages: int):  # -> Gear
    """A SmolLM2-135M gear (30 layers) on ``stages`` (1 or 2) of ``gpu_001`` / ``gpu_002`` with the
    envelope ``[rps_min, rps_max]`` req/s, target P99 500 ms and a matching estimate, for controller
    and sensor tests."""
    from flexpipe_dag.core.gear import Gear, GearEstimate, StagePlan

    bounds = [(0, 30)] if stages == 1 else [(0, 15), (15, 30)]
    devs = ["gpu_001", "gpu_002"]
    return Gear(gear_id=gear_id, kind=kind, model_name="SmolLM2-135M", num_layers=30, micro_batch_size=8,
                stages=[StagePlan(stage_index=i, layer_start=a, layer_end=b, device_ids=[devs[i]])
                        for i, (a, b) in enumerate(bounds)],
                rps_min=rps_min, rps_max=rps_max, target_p99_ms=500.0,
                estimate=GearEstimate(throughput_rps=rps_max, tokens_per_s=rps_max * 100, ttft_p50_ms=100,
                                      ttft_p99_ms=300, tpot_p50_ms=20, tpot_p99_ms=40, bottleneck_stage=0))


class RefusalsSince:
    """Mixin for stand-in runtimes: :meth:`PipelineRuntime.refusals_since` over the stand-in's ``refused`` dict
    (insertion-ordered, never trimmed; unlike the real one, an id set again is not handed out again)."""

    refused: dict[str, str]

    def refusals_since(self, cursor: int) -> tuple[dict[str, str], int]:
        items = list(self.refused.items())
        return dict(items[cursor:]), len(items)
