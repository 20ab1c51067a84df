"""Several instances of a gear write one serving-stream sample per round: the fleet's load, compared with the
fleet's envelope by the controller and the tide rule.

Before, each instance's window went on as a sample of its own: two instances of a gear read as one
pipeline carrying half the load, sample after sample, and the tide rule compared that with one instance's
capacity."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from flexpipe_dag.control.cursor import parse_cursor
from flexpipe_dag.control.service import evaluate_gear_shift, evaluate_tide
from flexpipe_dag.control.settings import ResolvedControlSettings
from flexpipe_dag.control.tide import TideConfig, TideForecaster
from flexpipe_dag.core.metrics import MetricSample, StageSample, merge_instance_samples
from flexpipe_dag.shift.instance_samples import InstanceRound
from flexpipe_dag.shift.router import ServingRouter
from tests.support import wait_until
from tests.test_control_service import MemoryStore, _samples
from tests.test_lane_idle import IdleRuntime


def _window(rps: float, *, completed: int = 0, p50: float | None = None, p99: float | None = None,
            busy: float = 0.5, used: int = 10, t_s: float = 2.0, gear_id: str = "g") -> MetricSample:
    return MetricSample(t_s=t_s, gear_id=gear_id, source="live", rps=rps, completed=completed, tokens_per_s=rps * 10,
                        queue_length=1, running=2, kv_used_fraction=used / 100, ttft_p50_ms=p50, ttft_p99_ms=p99,
                        stages=(StageSample(0, busy, 1, used, 100), StageSample(1, busy / 2, 0, used, 100)))


def test_merging_sums_the_load_and_bounds_the_latencies():
    a = _window(3.0, completed=6, p50=100.0, p99=400.0, busy=0.8, used=20, t_s=4.0)
    b = _window(1.0, completed=2, p50=300.0, p99=900.0, busy=0.4, used=60, t_s=3.9)
    c = _window(2.0, completed=0, used=40)  # finished nothing in its window: no latency of its own
    m = merge_instance_samples([a, b, c])
    assert (m.rps, m.completed, m.tokens_per_s, m.queue_length, m.running, m.instances) == (6.0, 8, 60.0, 3, 6, 3)
    assert m.t_s == 4.0 and m.gear_id == "g" and m.kv_used_fraction == pytest.approx(0.4)
    assert m.ttft_p50_ms == pytest.approx((6 * 100 + 2 * 300) / 8) and m.ttft_p99_ms == 900.0
    assert m.tpot_p99_ms is None  # nobody measured one
    assert [(st.stage_index, st.queue_length, st.kv_blocks_used, st.kv_blocks_total) for st in m.stages] == \
        [(0, 3, 120, 300), (1, 0, 120, 300)]
    assert m.stages[0].busy_fraction == pytest.approx((0.8 + 0.4 + 0.5) / 3)
    one = m.per_instance()
    assert (one.rps, one.completed, one.queue_length, one.running, one.instances) == (2.0, 3, 1, 2, 1)
    assert one.ttft_p99_ms == 900.0 and a.per_instance() is a
    assert merge_instance_samples([a]) is a
    with pytest.raises(ValueError, match="different gears"):
        merge_instance_samples([a, _window(1.0, gear_id="h")])
    with pytest.raises(ValueError, match="no sample"):
        merge_instance_samples([])


def test_a_round_closes_when_all_report_or_one_reports_twice():
    rounds = InstanceRound()
    members = ["g#1", "g#2", "g#3"]
    assert rounds.add("g#1", _window(1.0, completed=4, p99=500.0), members) is None
    assert rounds.add("g#2", _window(2.0), members) is None
    full = rounds.add("g#3", _window(3.0), members)
    assert full is not None and full.rps == 6.0 and full.instances == 3 and full.completed == 4
    # g#1 twice before the others: the round closes with g#2 and g#3 at their previous rates, nothing counted twice
    assert rounds.add("g#1", _window(1.5, completed=1), members) is None
    late = rounds.add("g#1", _window(1.0), members)
    assert late is not None and late.rps == 1.5 + 2.0 + 3.0 and late.completed == 1 and late.ttft_p99_ms is None
    # g#3 withdrawn and draining: its load counts, its envelope does not (two instances take requests)
    drained = [rounds.add(lid, _window(1.0), members, routed=2) for lid in ("g#2", "g#3")]
    assert drained[0] is None and drained[1].instances == 2 and drained[1].rps == 3.0  # g#1's 1.0 window is in
    # g#2 gone: a round of the two left; a lone member still reads as one instance at least
    assert rounds.add("g#3", _window(0.0), ["g#1", "g#3"], routed=0) is None
    alone = rounds.add("g#1", _window(2.0), ["g#1", "g#3"], routed=0)
    assert alone.instances == 1 and alone.rps == 2.0


def test_a_router_with_two_instances_hands_on_one_sample_per_round():
    got: list[MetricSample] = []
    router = ServingRouter(on_metrics=got.append)
    a, b = IdleRuntime("g"), IdleRuntime("g")
    try:
        router.open(a)
        router.route_to(router.add_lane(b, state="standby"))
        assert [ln.lane_id for ln in router.instances] == ["g#1", "g#2"]
        a.samples.append(_window(1.0, completed=2))
        wait_until(lambda: not a.samples, 5.0, "the entry point's sample")
        b.samples.append(_window(3.0, completed=1))
        wait_until(lambda: got, 5.0, "the merged sample")
        assert len(got) == 1 and got[0].rps == 4.0 and got[0].instances == 2 and got[0].completed == 3
        # idle windows of a further instance are part of the fleet's zero load now, not left out
        for rt in (a, b):
            rt.samples.append(_window(0.0))
        wait_until(lambda: len(got) == 2, 5.0, "the idle round")
        assert got[1].rps == 0.0 and got[1].instances == 2
        # a third instance warming up: its probes' windows are none of the fleet's traffic
        c = IdleRuntime("g")
        router.add_lane(c, state="warming")
        c.samples.append(_window(0.0, completed=1))
        wait_until(lambda: not c.samples, 5.0, "the warming lane's sample")
        a.samples.append(_window(1.0))
        b.samples.append(_window(1.0))
        wait_until(lambda: len(got) == 3, 5.0, "the next round")
        assert got[2].rps == 2.0 and got[2].completed == 0 and got[2].instances == 2
        router.lane("g#3").retire(5.0)
        # one instance left: its windows go on as they are
        router.withdraw(router.lane("g#2"))
        router.lane("g#2").retire(5.0)
        a.samples.append(_window(5.0))
        wait_until(lambda: len(got) == 4, 5.0, "the lone instance's sample")
        assert got[3].rps == 5.0 and got[3].instances == 1 and len(got) == 4
    finally:
        router.close()


def test_the_controller_reads_a_fleet_sample_per_instance_and_holds_its_gear():
    db = MemoryStore()
    # 2 instances of latency-1s (5 req/s each) at 8 req/s together: one instance would be far above its envelope
    db.write("live", [dataclasses.replace(s, instances=2) for s in _samples("latency-1s", [8.0] * 6)])
    ev = evaluate_gear_shift(db, None, ResolvedControlSettings())
    assert ev.decision.action == "hold" and ev.decision.reason_kind == "instances" and not db.events
    assert "2 instances of gear latency-1s" in ev.decision.reason
    state = parse_cursor(ev.cursor)[0]
    assert state.ema_rps == pytest.approx(4.0)  # per instance
    # back to one instance at the same fleet load: the controller decides again, and shifts up
    db.write("live", _samples("latency-1s", [8.0] * 6, t0=12.0))
    ev2 = evaluate_gear_shift(db, ev.cursor, ResolvedControlSettings())
    assert ev2.decision.action == "shift" and ev2.decision.trigger == "rps_above_envelope"


def test_the_tide_rule_compares_a_fleet_sample_with_the_fleets_capacity():
    from flexpipe_dag.workload.bundled import load_tide_trace

    forecaster = TideForecaster(load_tide_trace())
    trough_s = float(min(range(0, 86400, 600), key=forecaster.profile_at))
    decisions = {}
    for instances in (1, 2):
        db = MemoryStore()
        db.batch = [SimpleNamespace(id=7, job_key="offline-1", kind="batch", status="queued",
                                    config={"num_requests": 8}, admissions=0)]
        # 30 req/s on throughput-2s (40 req/s an instance): above half of one, below half of two
        db.write("live", [dataclasses.replace(s, instances=instances) for s in _samples("throughput-2s", [30.0] * 3)])
        cursor = None
        for _ in range(2):
            ev = evaluate_tide(db, cursor, TideConfig(hysteresis_samples=2), epoch_s=trough_s, forecaster=forecaster)
            cursor = ev.cursor
        decisions[instances] = ev.decision
        # nothing new: the cursor keeps the instance count, so the capacity stays the fleet's
        again = evaluate_tide(db, cursor, TideConfig(hysteresis_samples=2), epoch_s=trough_s, forecaster=forecaster)
        assert again.decision.capacity_rps == 40.0 * instances
    assert decisions[1].action == "keep" and decisions[2].action == "admit"


def test_the_store_keeps_the_instance_count_and_refuses_a_bad_one(tmp_path):
    from flexpipe_dag.core.errors import InputError
    from flexpipe_dag.sql.store import Store

    db = Store.from_url(f"sqlite:///{tmp_path / 'fp.db'}")
    db.write_samples("r", [_window(1.0), dataclasses.replace(_window(4.0, t_s=4.0), instances=3)])
    assert [s.instances for _, s in db.read_samples(run_key="r")] == [1, 3]
    for bad in (0, 1.5, None):
        with pytest.raises(InputError, match="instances"):
            db.write_samples("r", [dataclasses.replace(_window(1.0, t_s=6.0), instances=bad)])
    assert len(db.read_samples(run_key="r")) == 2


def test_samples_handed_on_in_the_same_millisecond_are_stored_with_rising_times(monkeypatch):
    """LiveControl stamps a sample when it is received; two received together (a backlog, two lanes) must
    not share a ``t_s``: the controller reads a sample not after the last one read as read already."""
    from flexpipe_dag.serving import live_control

    stored: list[MetricSample] = []
    store = SimpleNamespace(write_samples=lambda run_key, batch: stored.extend(batch))
    live = live_control.LiveControl(store, None, None, None, (), "serve-1", log=lambda line: None)
    now = [live.t0 + 5.0]
    monkeypatch.setattr(live_control.time, "monotonic", lambda: now[0])
    for rps in (1.0, 2.0, 3.0):
        live.on_metrics(_window(rps))
    live.write_samples()
    live.on_metrics(_window(4.0))  # the next control step, still in the same millisecond
    live.write_samples()
    assert [s.rps for s in stored] == [1.0, 2.0, 3.0, 4.0]
    assert [s.t_s for s in stored] == [5.0, 5.001, 5.002, 5.003]
    now[0] += 2.0
    live.on_metrics(_window(5.0))
    live.write_samples()
    assert stored[-1].t_s == 7.0


def test_a_new_instance_warming_beside_one_entry_point_is_left_out_of_the_serving_stream():
    """Before its first request is routed to it, a new instance of the serving gear holds only its warm-up's
    probes: its windows (tokens, running) read as the serving gear's, the store showed them as traffic."""
    got: list[MetricSample] = []
    router = ServingRouter(on_metrics=got.append)
    entry, warming, other = IdleRuntime("g"), IdleRuntime("g"), IdleRuntime("h")
    try:
        router.open(entry)
        router.add_lane(warming, state="warming")
        router.add_lane(other, state="warming")  # a shift's new gear: its windows go on as before
        warming.samples.append(dataclasses.replace(_window(0.0), running=1))
        wait_until(lambda: not warming.samples, 5.0, "the warming instance's sample")
        other.samples.append(dataclasses.replace(_window(0.0, gear_id="h"), running=1))
        wait_until(lambda: got, 5.0, "the other gear's sample")
        entry.samples.append(_window(2.0))
        wait_until(lambda: len(got) == 2, 5.0, "the entry point's sample")
        assert [(s.gear_id, s.rps, s.instances) for s in got] == [("h", 0.0, 1), ("g", 2.0, 1)]
    finally:
        router.close()
