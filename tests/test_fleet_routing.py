"""The router's choice among several instances, on stand-in runtimes (no processes, fast): least
outstanding work, KV-aware admission, the router's own refusal, withdrawal and failover, exactly once.

The real pipelines are in tests/test_fleet_instances.py."""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.shift.router import ServingRouter
from tests.support import RefusalsSince, wait_until


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int


@dataclass
class Out:
    request_id: str
    output_token_ids: list[int] = field(default_factory=list)


class StandInRuntime(RefusalsSince):
    """What a lane uses of a PipelineRuntime; finishes what it was given whenever ``serving`` is set."""

    def __init__(self, gear_id: str, longest_request_tokens: int = 2049):
        self.gear = SimpleNamespace(gear_id=gear_id, num_stages=1)
        self.options = SimpleNamespace(truncate_context=False)
        self.max_context_tokens = 8192
        self.longest_request_tokens = longest_request_tokens
        self.refused: dict[str, str] = {}
        self.submitted: list[str] = []
        self.serving = threading.Event()
        self.stopped = False
        self.crash: str | None = None  # the next wait raises this (a stage failure)
        self.cancelled: list[str] = []
        self.aborts: list[str] = []
        self._queue: queue.Queue = queue.Queue()

    def submit(self, reqs):
        for r in reqs:
            self.submitted.append(r.request_id)
            self._queue.put(r)

    def wait(self, on_result=None, on_metrics=None, on_tokens=None):
        if self.crash is not None:
            raise RuntimeError(self.crash)
        if not self.serving.wait(0.02):
            return
        while self.aborts:
            on_result(Out(self.aborts.pop(0)))
        while True:
            try:
                r = self._queue.get_nowait()
            except queue.Empty:
                return
            on_result(Out(r.request_id, [len(r.prompt_token_ids)]))

    def poll(self, timeout_s, on_result=None, on_metrics=None, on_tokens=None):
        """As the real one while idle: nothing outstanding, so nothing comes (this stand-in samples nothing)."""
        time.sleep(timeout_s)
        return 0

    @property
    def num_outstanding(self):
        return self._queue.qsize() + len(self.aborts)

    def cancel(self, request_ids):
        """As the real one: each id still queued comes back as an abort output (on the next serving wait)."""
        self.cancelled.extend(request_ids)
        self.aborts.extend(request_ids)

    def shutdown(self, timeout_s: float = 30.0):
        self.stopped = True

    def stage_pids(self):
        return []


def _req(rid: str, prompt: int, new: int) -> Req:
    return Req(rid, list(range(1, prompt + 1)), new)


@pytest.fixture
def fleet():
    got, refused = collections.Counter(), {}
    router = ServingRouter(on_result=lambda out: got.update([out.request_id]),
                           on_refused=lambda rid, why: refused.__setitem__(rid, why))
    a, b = StandInRuntime("a"), StandInRuntime("b", longest_request_tokens=60)
    lanes = [router.add_lane(rt) for rt in (a, b)]
    for lane in lanes:
        router.route_to(lane)
    yield router, lanes, (a, b), got, refused
    for rt in (a, b):
        rt.serving.set()
    router.close()


def test_least_outstanding_tokens_wins_and_ties_go_to_the_entry_point(fleet):
    router, (la, lb), _, _, _ = fleet
    assert router.active is la and router.instances == [la, lb]
    for rid, prompt, new in (("r1", 40, 10), ("r2", 40, 10), ("r3", 5, 5), ("r4", 40, 10), ("r5", 1, 1)):
        router.submit([_req(rid, prompt, new)])
    where = {rid: router.ledger.get(rid).lane_id for rid in ("r1", "r2", "r3", "r4", "r5")}
    # r1 tie -> a; r2 -> b (a has 50); r3 tie 50/50 on tokens and count -> a; r4 -> b (50 < 60); r5 -> a (60 < 100)
    assert where == {"r1": la.lane_id, "r2": lb.lane_id, "r3": la.lane_id, "r4": lb.lane_id, "r5": la.lane_id}
    assert router.ledger.open_tokens(la.lane_id) == 62 and router.ledger.open_tokens(lb.lane_id) == 100


def test_kv_aware_admission_and_the_routers_refusal(fleet):
    router, (la, lb), (a, b), got, refused = fleet
    router.submit([_req("busy", 40, 10)])  # a is busier now
    router.submit([_req("long", 40, 30)])  # 70 tokens: b holds at most 60
    assert router.ledger.get("long").lanes == [la.lane_id]
    router.submit([_req("huge", 40, 5000)])
    why = refused["huge"]
    assert "no instance can hold it" in why and "= 5040 tokens" in why and f"{lb.lane_id} 60" in why, why
    assert "huge" not in a.submitted + b.submitted
    a.serving.set()
    assert router.wait_idle(5.0) and got == {"busy": 1, "long": 1}


def test_withdrawn_instance_drains_and_a_stopped_ones_requests_move_once(fleet):
    router, (la, lb), (a, b), got, _ = fleet
    a.serving.set()  # b sits on what it gets
    submitted = router.submit([_req(f"q{i}", 10, 10) for i in range(6)])
    on_b = [rid for rid in submitted if router.ledger.get(rid).lane_id == lb.lane_id]
    assert on_b
    router.withdraw(lb)
    assert lb.state == "draining" and router.instances == [la]
    later = router.submit([_req(f"late{i}", 1, 1) for i in range(4)])
    assert all(router.ledger.get(rid).lanes == [la.lane_id] for rid in later)
    with pytest.raises(InputError, match="last live instance"):
        router.withdraw(la)
    lb.force_stop()  # b did not drain: what it held is re-submitted to a
    assert router.wait_idle(5.0)
    assert set(got) == set(submitted + later) and set(got.values()) == {1}
    assert router.ledger.counts()["moved"] == len(on_b) and b.stopped


def test_withdrawing_the_entry_point_promotes_the_least_loaded_instance(fleet):
    router, (la, lb), (a, b), got, _ = fleet
    c = StandInRuntime("c")
    lc = router.add_lane(c)
    router.route_to(lc)
    router.submit([_req("x", 10, 10), _req("y", 10, 10)])  # a and b get one each, c none
    router.withdraw(la)
    assert router.active is lc and router.instances == [lc, lb]
    for rt in (a, b, c):
        rt.serving.set()
    wait_until(lambda: router.ledger.num_open() == 0, 5.0, "the requests to finish")
    assert got == {"x": 1, "y": 1}


def test_one_instance_keeps_the_runtimes_own_refusal():
    router = ServingRouter()
    rt = StandInRuntime("only", longest_request_tokens=60)
    with router:
        router.route_to(router.add_lane(rt))
        router.submit([_req("long", 40, 30)])  # no check of the router's own: the runtime decides
        assert rt.submitted == ["long"]
        rt.serving.set()
        assert router.wait_idle(5.0)


def test_a_failed_entry_point_hands_its_requests_and_the_entry_to_another_instance(fleet):
    router, (la, lb), (a, b), got, _ = fleet
    submitted = router.submit([_req(f"f{i}", 10, 10) for i in range(4)])
    assert router.ledger.num_open(la.lane_id) == 2
    a.crash = "stage 0 crashed"
    wait_until(lambda: la.state == "failed", 5.0, "the entry point to fail")
    assert router.active is lb and router.instances == [lb]
    assert router.failures and "stage 0 crashed" in router.failures[0][1]
    b.serving.set()
    assert router.wait_idle(5.0)
    assert set(got) == set(submitted) and set(got.values()) == {1} and router.ledger.counts()["moved"] == 2


def test_a_cancelled_request_leaves_its_lane_at_once_and_is_never_delivered_or_moved(fleet):
    router, (la, lb), (a, b), got, refused = fleet
    router.submit([_req("keep", 10, 10), _req("gone", 10, 10)])  # one on each instance
    gone_lane = router.ledger.get("gone").lane_id
    gone_rt = a if gone_lane == la.lane_id else b
    before = router.ledger.open_tokens(gone_lane)
    assert router.cancel("gone") is True
    assert gone_rt.cancelled == ["gone"] and router.ledger.open_tokens(gone_lane) == before - 20
    assert router.ledger.get("gone").status == "cancelled" and router.ledger.num_open() == 1
    assert router.cancel("gone") is False and router.cancel("unknown") is False  # nothing to do twice
    gone_rt.crash = "stage 1 crashed"  # its lane fails: a cancelled request is not moved to the other
    other = b if gone_rt is a else a
    other.serving.set()
    assert router.wait_idle(5.0)
    counts = router.ledger.counts()
    assert got == {"keep": 1} and not refused and "gone" not in other.submitted
    assert counts["cancelled"] == 1 and counts["moved"] == 0 and counts["duplicates_dropped"] == 0


def test_an_abort_output_after_a_cancel_is_dropped_without_counting_as_a_duplicate():
    got = collections.Counter()
    router = ServingRouter(on_result=lambda out: got.update([out.request_id]))
    rt = StandInRuntime("only")
    with router:
        router.route_to(router.add_lane(rt))
        router.submit([_req("r", 5, 5), _req("s", 5, 5)])
        router.cancel("r")
        router.submit([_req("t", 5, 5)])
        rt.serving.set()  # serves "r"'s abort, then what was queued ("r" too: it was not taken out)
        assert router.wait_idle(5.0)
        wait_until(lambda: not rt.aborts, 5.0, "the abort output")
    assert got == {"s": 1, "t": 1} and router.ledger.counts()["duplicates_dropped"] == 0


def test_a_held_request_cancelled_is_never_sent():
    router = ServingRouter()
    with router:
        router.submit([_req("waits", 5, 5), _req("stays", 5, 5)])  # no pipeline yet: both held
        assert router.cancel("waits")
        rt = StandInRuntime("late")
        rt.stage_info = ["started"]  # open() starts a runtime without any
        router.open(rt)
        rt.serving.set()
        assert router.wait_idle(5.0)
    assert rt.submitted == ["stays"] and rt.cancelled == []


def test_a_router_forgets_its_oldest_dead_lanes_beyond_the_bound(monkeypatch):
    """A server shifts for days: retired (and failed) lanes beyond DEAD_LANES_KEPT are forgotten, oldest first;
    the live ones and the newest dead ones stay, and a forgotten one's id is refused by name."""
    import flexpipe_dag.shift.router as router_mod

    monkeypatch.setattr(router_mod, "DEAD_LANES_KEPT", 2)
    with ServingRouter() as router:
        first = StandInRuntime("entry")
        first.stage_info = ["started"]  # open() starts a runtime without any
        entry = router.open(first)
        gone = []
        for i in range(5):
            lane = router.add_lane(StandInRuntime(f"g{i}"), state="standby")
            lane.retire(1.0)
            gone.append(lane.lane_id)
        assert [ln.lane_id for ln in router.lanes] == [entry.lane_id, *gone[-2:]]
        assert router.lane(gone[-1]).state == "retired" and router.active is entry
        with pytest.raises(InputError, match=gone[0]):
            router.lane(gone[0])
