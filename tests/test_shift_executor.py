"""Shifts on the real runtime (CPU, SmolLM2): nothing lost, nothing duplicated, greedy outputs unchanged.

Every test serves the runtime tests' prompts (ids ``"<tag>-<prompt index>"``) through a
:class:`ServingRouter` and compares each output with single-process transformers greedy
``generate`` (``hf_reference``: the run without any shift).
"""

from __future__ import annotations

import collections
import os
import threading
import time

import pytest

pytest.importorskip("torch")

from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, stage_memory_bytes
from flexpipe_dag.shift import GearExecutor, ServingRouter, ShiftConfig
from tests.support import BackgroundThread, wait_until
from tests.test_runtime_helpers import PROMPTS, checkpoint, gear, hf_reference, requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAST = dict(warmup_requests=2, warmup_max_new_tokens=4, health_window_s=2.0, probe_interval_s=0.5,
            warmup_timeout_s=120.0, drain_timeout_s=60.0, probe_timeout_s=30.0)
#: Deadlines of the test's own waits: the first submissions (the runtime is already up), the router
#: going idle after a shift, the load thread stopping.
SUBMIT_TIMEOUT_S, IDLE_TIMEOUT_S, JOIN_TIMEOUT_S = 60.0, 120.0, 120.0


class Sink:
    """Collects outputs; counts deliveries per id so a duplicate cannot hide."""

    def __init__(self):
        self.outputs: dict[str, list[int]] = {}
        self.deliveries = collections.Counter()
        self.refused: dict[str, str] = {}

    def __call__(self, out):
        self.deliveries[out.request_id] += 1
        self.outputs[out.request_id] = list(out.output_token_ids)

    def check(self, submitted: list[str]):
        ref = hf_reference()
        assert not self.refused
        assert sorted(self.deliveries) == sorted(submitted), "a request was lost"
        assert set(self.deliveries.values()) == {1}, "a request was delivered twice"
        wrong = {rid: toks for rid, toks in self.outputs.items() if toks != ref[rid.split("-")[-1]]}
        assert not wrong, f"outputs differ from the run without a shift: {wrong}"


class Load:
    """Submits one request every ``interval_s`` in a background thread until stopped (then ``tail`` more).

    A load thread that dies (``submit`` raised) fails :meth:`wait_submitted` at once with its error,
    and the ``with`` block's exit, instead of leaving the test waiting for submissions."""

    def __init__(self, router: ServingRouter, tag: str, interval_s: float = 2.0, tail: int = 3, cap: int = 200):
        self.router, self.tag, self.interval_s, self.tail, self.cap = router, tag, interval_s, tail, cap
        self.submitted: list[str] = []
        self._stop = threading.Event()
        self.thread = BackgroundThread(self._run, name=f"load-{tag}")

    def _run(self):
        reqs = requests()
        k, extra = 0, None
        while k < self.cap and (extra is None or extra > 0):
            r = reqs[k % len(PROMPTS)]
            r = type(r)(f"{self.tag}{k}-{k % len(PROMPTS)}", r.prompt_token_ids, r.max_new_tokens,
                        eos_token_ids=r.eos_token_ids)
            self.submitted += self.router.submit([r])
            k += 1
            if self._stop.is_set():
                extra = self.tail if extra is None else extra - 1
            time.sleep(self.interval_s)

    def wait_submitted(self, n: int) -> None:
        """Block until ``n`` requests were submitted (deadline :data:`SUBMIT_TIMEOUT_S`)."""
        wait_until(lambda: len(self.submitted) >= n, SUBMIT_TIMEOUT_S, f"the load thread to submit {n} requests",
                   thread=self.thread)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        self._stop.set()
        if exc_type is None:  # else the block's own failure is the one to report
            self.thread.join_or_fail(JOIN_TIMEOUT_S)


def _wait_idle(router: ServingRouter) -> None:
    assert router.wait_idle(timeout_s=IDLE_TIMEOUT_S), \
        f"timed out after {IDLE_TIMEOUT_S} s waiting for the router to finish its {router.ledger.num_open()} open requests"


def _old_router(sink: Sink, ranges=((0, 30),), options: RuntimeOptions | None = None):
    router = ServingRouter(on_result=sink, on_refused=lambda rid, why: sink.refused.__setitem__(rid, why))
    router.open(PipelineRuntime(gear(list(ranges), micro_batch_size=4, gear_id="old"), checkpoint(), options))
    return router


def _gone(pids):
    return all(not os.path.exists(f"/proc/{pid}") for pid in pids)


def test_shift_under_continuous_load_loses_and_duplicates_nothing():
    hf_reference()  # computed before the workers compete for the CPU
    sink = Sink()
    with _old_router(sink) as router:
        old = router.active
        old_pids = old.runtime.stage_pids()
        executor = GearExecutor(router, ShiftConfig(**FAST))
        with Load(router, "s") as load:
            load.wait_submitted(4)
            outcome = executor.shift(gear([(0, 8), (8, 30)], micro_batch_size=4, gear_id="new"))
        _wait_idle(router)
        new = router.active
        print("shift", outcome.status, outcome.timings_s, outcome.details.get("start_s"), len(load.submitted))
        assert outcome.status == "done", outcome
        assert outcome.mode == "shadow" and outcome.failed_step is None and outcome.requests_moved == 0
        assert {"warmup", "verify", "switch", "drain", "health", "release"} <= set(outcome.timings_s)
        assert new.gear.gear_id == "new" and [(i["layer_start"], i["layer_end"]) for i in new.runtime.stage_info] \
            == [(0, 8), (8, 30)]
        assert old.state == "retired" and _gone(old_pids)  # old processes and their memory released
        led = router.ledger
        assert led.num_finished_by(old.lane_id) > 0 and led.num_finished_by(new.lane_id) > 0
        assert 0 < outcome.requests_on_new <= led.num_admitted_to(new.lane_id) == led.num_finished_by(new.lane_id)
        sink.check(load.submitted)


def test_failing_new_gear_rolls_back_and_loses_nothing():
    hf_reference()
    sink = Sink()
    with _old_router(sink) as router:
        old = router.active
        executor = GearExecutor(router, ShiftConfig(**FAST))
        # stage 1 of the new gear raises after 12 steps: the warm-up (8 steps) passes, live traffic kills it
        faulty = RuntimeOptions(fault={"stage": 1, "raise_after_steps": 12})
        with Load(router, "r") as load:
            load.wait_submitted(3)
            outcome = executor.shift(gear([(0, 20), (20, 30)], micro_batch_size=4, gear_id="bad"), options=faulty)
        _wait_idle(router)
        print("rollback", outcome.timings_s, outcome.details.get("start_s"), "requests", len(load.submitted))
        assert outcome.status == "rolled_back", outcome
        assert outcome.failed_step in ("drain", "health") and "injected fault" in outcome.reason
        assert outcome.new_gear_at_fault and outcome.unhealthy_gear_id == "bad"
        assert outcome.requests_on_new > 0 and "rollback" in outcome.timings_s
        assert router.active is old and old.state == "active"  # the double buffer kept the old gear alive
        sink.check(load.submitted)


def test_warmup_and_drain_timeouts_become_rollbacks():
    hf_reference()
    sink = Sink()
    with _old_router(sink) as router:
        old = router.active
        submitted = []
        # warm-up timeout: start + warm-up cannot finish in 0.05 s
        slow = GearExecutor(router, ShiftConfig(**{**FAST, "warmup_timeout_s": 0.05}))
        out1 = slow.shift(gear([(0, 15), (15, 30)], gear_id="slow"))
        assert out1.status == "rolled_back" and out1.failed_step == "warmup", out1
        assert ("did not load" in out1.reason or "timed out" in out1.reason) and out1.new_gear_at_fault
        assert router.active is old
        # drain timeout: requests sent to the old gear right before the switch cannot finish in 0.05 s
        executor = GearExecutor(router, ShiftConfig(**{**FAST, "drain_timeout_s": 0.05}))
        switch_to = router.switch_to

        def busy_switch(lane):
            if lane is not old:
                submitted.extend(router.submit(requests(prefix="d-")))
            return switch_to(lane)

        router.switch_to = busy_switch
        with Load(router, "t") as load:
            out2 = executor.shift(gear([(0, 15), (15, 30)], micro_batch_size=4, gear_id="ok"))
        _wait_idle(router)
        assert out2.status == "rolled_back" and out2.failed_step == "drain", out2
        assert not out2.new_gear_at_fault and out2.unhealthy_gear_id is None
        assert router.active is old and all(ln.state in ("retired", "failed") for ln in router.lanes if ln is not old)
        sink.check(submitted + load.submitted)


def test_degraded_mode_warms_with_a_small_kv_pool_and_grows_it_after_the_switch():
    hf_reference()
    ckpt = checkpoint()
    old_gear = gear([(0, 30)], micro_batch_size=4, gear_id="old")
    new_gear = gear([(0, 10), (10, 30)], micro_batch_size=4, kv_capacity_tokens=2048, gear_id="new")
    old_row, = stage_memory_bytes(old_gear, ckpt)
    new_rows = stage_memory_bytes(new_gear, ckpt)
    # cpu0 holds the old gear, the new stage 0's weights and a quarter of its KV pool (+ the 10 % reserve)
    cpu0 = int((old_row["total_bytes"] + new_rows[0]["param_bytes"] + new_rows[0]["kv_pool_bytes"] // 4) / 0.9)
    options = RuntimeOptions(device_memory_bytes={"cpu0": cpu0, "cpu1": 8 * 2**30})
    sink = Sink()
    with _old_router(sink, options=options) as router:
        executor = GearExecutor(router, ShiftConfig(**FAST))
        with Load(router, "g") as load:
            load.wait_submitted(3)
            outcome = executor.shift(new_gear)
        _wait_idle(router)
        print("degraded", outcome.timings_s, "requests", len(load.submitted))
        assert outcome.status == "done" and outcome.mode == "degraded", outcome
        warm = outcome.details["warm_kv_tokens"]
        assert 256 <= warm < 2048 and warm % 16 == 0 and outcome.details["kv_grown_to_tokens"] == 2048
        assert "grow" in outcome.timings_s
        assert [i["kv_capacity_tokens"] for i in router.active.runtime.stage_info] == [2048, 2048]
        sink.check(load.submitted)


def test_cold_shift_in_place_when_memory_is_too_short_for_two_gears():
    hf_reference()
    ckpt = checkpoint()
    old_gear = gear([(0, 20), (20, 30)], micro_batch_size=4, gear_id="old")
    new_gear = gear([(0, 10), (10, 30)], micro_batch_size=4, gear_id="new")
    old0 = stage_memory_bytes(old_gear, ckpt)[0]["total_bytes"]
    # cpu0 holds the old stage 0 and little else: the new gear can only replace it, not sit beside it
    options = RuntimeOptions(device_memory_bytes={"cpu0": int(old0 * 1.05), "cpu1": 8 * 2**30})
    sink = Sink()
    router = ServingRouter(on_result=sink)
    with router:
        lane = router.open(PipelineRuntime(old_gear, ckpt, options))
        pids = lane.runtime.stage_pids()
        with Load(router, "c") as load:
            load.wait_submitted(2)
            outcome = GearExecutor(router, ShiftConfig(**FAST)).shift(new_gear)
        _wait_idle(router)
        print("cold", outcome.timings_s, "requests", len(load.submitted))
        assert outcome.status == "done" and outcome.mode == "in_place", outcome
        assert outcome.details["residency"]["mode"] == "cold"
        assert router.active is lane and lane.runtime.stage_pids() == pids  # same processes, new layer ranges
        assert [(i["layer_start"], i["layer_end"]) for i in lane.runtime.stage_info] == [(0, 10), (10, 30)]
        sink.check(load.submitted)
