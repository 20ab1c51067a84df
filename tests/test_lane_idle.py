"""An idle lane keeps reading its runtime: an idle server's zero-load samples reach the controller, a
standby or draining lane's empty windows do not, and a stage that dies while idle is found at once.

Before, the pump read a runtime only while requests were open: an idle server wrote no sample (the
sensors saw it as not live and never shifted it down in a trough), and the next request brought the
whole idle backlog at once."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest

from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.shift.router import ServingRouter
from tests.support import RefusalsSince, wait_until


def _sample(gear_id: str, **figures) -> MetricSample:
    base = dict(t_s=1.0, gear_id=gear_id, source="live", rps=0.0, completed=0, tokens_per_s=0.0, queue_length=0,
                running=0, kv_used_fraction=0.0)
    return MetricSample(**{**base, **figures})


class IdleRuntime(RefusalsSince):
    """Stand-in runtime with nothing outstanding; each ``poll`` hands out the next queued sample."""

    def __init__(self, gear_id: str):
        self.gear = SimpleNamespace(gear_id=gear_id, num_stages=1)
        self.refused: dict[str, str] = {}
        self.num_outstanding = 0
        self.stage_info = ["started"]  # ServingRouter.open starts a runtime without it
        self.samples: list[MetricSample] = []
        self.polls = threading.Semaphore(0)
        self.waits = 0

    def poll(self, timeout_s, on_result=None, on_metrics=None, on_tokens=None):
        self.polls.release()
        if not self.samples:
            threading.Event().wait(timeout_s)
            return 0
        on_metrics(self.samples.pop(0))
        return 1

    def wait(self, on_result=None, on_metrics=None, on_tokens=None):
        self.waits += 1

    def shutdown(self, timeout_s: float = 30.0):
        pass

    def stage_pids(self):
        return []


@pytest.mark.parametrize("state, figures, passed_on", [
    ("entry", {}, True),                     # the idle entry point: its zero load is the news
    ("active", {}, False),                   # a further instance: its empty windows would halve the rate
    ("standby", {}, False),                  # the rollback target's empty windows are nobody's traffic
    ("draining", {}, False),
    ("warming", {}, False),
    ("draining", {"completed": 2, "tokens_per_s": 3.5}, True),  # the window of its last requests
    ("standby", {"running": 1}, True),
    ("warming", {"queue_length": 1}, True),
    ("standby", {"rps": 0.5}, True),
])
def test_idle_samples_are_passed_on_from_a_serving_lane_or_when_they_record_work(state, figures, passed_on):
    got: list[MetricSample] = []
    every: list[tuple[str, MetricSample]] = []
    router = ServingRouter(on_metrics=got.append, on_lane_sample=lambda lane_id, smp: every.append((lane_id, smp)))
    rt = IdleRuntime("g")
    try:
        if state == "entry":
            router.open(rt)
        else:
            router.add_lane(rt, state=state)
        rt.samples.append(_sample("g", **figures))  # once the lane has its place in the router
        wait_until(lambda: not rt.samples, 5.0, "the idle pump to poll the sample")
        while rt.polls.acquire(blocking=False):  # polls so far
            pass
        for _ in range(2):  # two polls begun after it: the one that handed it out has passed it on
            assert rt.polls.acquire(timeout=5.0), "the idle pump stopped polling"
        assert [s.gear_id for s in got] == (["g"] if passed_on else [])
        assert [lane_id for lane_id, _ in every] == ["g#1"]  # every sample reaches the per-pipeline gauges
        assert rt.waits == 0  # nothing was open: wait (which returns only once all finished) is never called
    finally:
        router.close()


def test_run_exclusive_gets_the_lane_from_a_pump_that_polls_without_pause():
    router = ServingRouter()
    rt = IdleRuntime("g")
    try:
        lane = router.add_lane(rt, state="active")
        for _ in range(20):  # the pump takes the lock again right after each poll: a waiter must still get in
            assert lane.run_exclusive(lambda r: r.gear.gear_id, timeout_s=2.0) == "g"
    finally:
        router.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_idle_pipeline_samples_zero_load_and_a_stage_killed_idle_is_found():
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from tests.test_runtime_helpers import checkpoint, gear

    got: list[MetricSample] = []
    options = RuntimeOptions(metrics_period_s=0.25)
    with ServingRouter(on_metrics=got.append) as router:
        serving = router.open(PipelineRuntime(gear([(0, 30)], micro_batch_size=2, gear_id="serving"), checkpoint(),
                                              options))
        spare = PipelineRuntime(gear([(0, 30)], micro_batch_size=2, gear_id="spare"), checkpoint(), options)
        spare.start()
        router.add_lane(spare, state="standby")
        wait_until(lambda: len(got) >= 4, 60.0, "four samples of the idle serving pipeline")
        assert {s.gear_id for s in got} == {"serving"}, "the standby lane's empty windows were passed on"
        assert all(s.rps == 0 and s.completed == 0 and s.running == 0 and s.queue_length == 0 for s in got)
        assert [s.t_s for s in got] == sorted(s.t_s for s in got)
        # no request is open anywhere: the failure is found by the idle pump, not by a request
        os.kill(serving.runtime.stage_pids()[0], signal.SIGKILL)
        wait_until(lambda: serving.state == "failed", 60.0, "the idle lane's stage failure to be found")
        assert router.failures and router.failures[0][0] == serving.lane_id
        assert "stage 0" in router.failures[0][1] or "exited" in router.failures[0][1], router.failures


def test_a_serving_runtimes_refusals_stay_bounded_and_a_lane_hands_each_out_once(monkeypatch):
    """Outside ``generate`` a runtime remembers only its newest REFUSALS_KEPT refusals (a server refuses for days);
    inside it keeps every one for the report. A lane's cursor hands each refusal to the owner once, a repeated
    id (a client's retry) again."""
    import flexpipe_dag.runtime.pipeline as pipeline
    from flexpipe_dag.runtime.messages import RequestRefused
    from flexpipe_dag.shift.lane import Lane
    from tests.support import enveloped_gear

    monkeypatch.setattr(pipeline, "REFUSALS_KEPT", 5)
    rt = pipeline.PipelineRuntime(enveloped_gear("g", "balanced", 0.1, 1.0, 1))  # never started: no processes
    handed: list[dict[str, str]] = []
    owner = SimpleNamespace(lane_refused=lambda lane, fresh: handed.append(fresh))
    lane = Lane("g#1", rt, owner)
    for i in range(12):
        rt._note_refusal(RequestRefused(f"r{i}", f"why {i}"))
        if i in (2, 3):
            assert lane.poll_refusals() == (3 if i == 2 else 1)
    assert list(rt.refused) == [f"r{i}" for i in range(7, 12)]  # the newest 5: r4-r6, never polled, forgotten
    assert lane.poll_refusals() == 5 and handed[-1] == {f"r{i}": f"why {i}" for i in range(7, 12)}
    assert lane.poll_refusals() == 0
    rt._note_refusal(RequestRefused("r9", "again"))
    assert lane.poll_refusals() == 1 and handed[-1] == {"r9": "again"}
    rt._note_refusal(RequestRefused("z", "first"))
    rt._note_refusal(RequestRefused("z", "second"))  # twice between two polls: only its newest, and nothing older
    assert lane.poll_refusals() == 1 and handed[-1] == {"z": "second"}
    assert [list(h) for h in handed[:2]] == [["r0", "r1", "r2"], ["r3"]] and len(rt.refused) == 5
    rt._keep_finished = True  # as inside generate(): its report names every refusal
    for i in range(20):
        rt._note_refusal(RequestRefused(f"g{i}", "why"))
    assert len(rt.refused) == 25 and lane.poll_refusals() == 20
