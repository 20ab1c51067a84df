"""Offline work in the online gear's spare capacity: the simulator's ``submit``, samples that watch online only,
and the serve loop's trough rule feeding a simulated day (:mod:`flexpipe_dag.control.offline_share`)."""

from __future__ import annotations

import pytest

from flexpipe_dag.control.offline_fill import OfflineBacklog
from flexpipe_dag.control.offline_share import OfflineShare
from flexpipe_dag.control.tide import TideConfig
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime.live_metrics import LiveMetrics
from flexpipe_dag.runtime.scheduler import PRIORITY_OFFLINE
from flexpipe_dag.sim import LinearStageTiming, SimConfig, Simulator, manual_gear
from flexpipe_dag.workload import Request, Workload

TIMING = LinearStageTiming.uniform(1, prefill_fixed_ms=100)


def _online(n: int, every_s: float, start_s: float = 0.0) -> Workload:
    return Workload.from_requests([Request(f"on{i}", start_s + i * every_s, 10, 1) for i in range(n)], name="on")


def _jobs(n: int) -> list[Request]:
    return [Request(f"job{i}", 0.0, 10, 1, "offline") for i in range(n)]


def test_submitted_work_queues_behind_online_and_is_in_the_result():
    gear = manual_gear([1], micro_batch_size=1, max_inflight_micro_batches=1)
    sim = Simulator(_online(1, 1.0, start_s=0.35), gear, TIMING)
    sim.submit(_jobs(20))
    assert sim.offline_open == 20
    res = sim.run().requests.set_index("request_id")
    # as test_online_before_offline: the online request waits only for the job in service
    assert res.loc["on0", "finish_s"] == pytest.approx(0.5)
    assert res[res["class"] == "offline"]["finish_s"].max() == pytest.approx(21 * 0.1)
    assert len(res) == 21 and (res.loc["job3", "arrival_s"] == 0.0) and sim.offline_open == 0
    with pytest.raises(InputError, match="already in this simulation"):
        sim.submit(_jobs(1))


def test_submitted_work_over_the_context_is_cut_or_refused_by_the_config_rule():
    gear = manual_gear([1], micro_batch_size=4)
    long = [Request("long", 0.0, 5000, 10, "offline")]
    cut = Simulator(_online(1, 1.0), gear, TIMING, SimConfig(max_context_tokens=4096, context_policy="truncate"))
    cut.submit(long)
    res = cut.run().requests.set_index("request_id")
    assert res.loc["long", "input_tokens"] + res.loc["long", "output_tokens"] <= 4096 and res.loc["long", "finish_s"] > 0
    refuse = Simulator(_online(1, 1.0), gear, TIMING, SimConfig(max_context_tokens=4096))
    refuse.submit(long)
    assert refuse.offline_open == 0 and bool(refuse.run().requests.set_index("request_id").loc["long", "rejected"])


def test_samples_count_online_latency_and_completions_only():
    gear = manual_gear([1], micro_batch_size=1, max_inflight_micro_batches=1)
    sim = Simulator(_online(1, 1.0, start_s=3.0), gear, TIMING)
    sim.submit(_jobs(10))  # 1 s of offline work, each job's TTFT up to 1 s
    samples = sim.advance(4.0)
    assert sum(s.completed for s in samples) == 1 and sum(s.rps for s in samples) * 2.0 == 1
    ttft = [s.ttft_p99_ms for s in samples if s.ttft_p99_ms is not None]
    assert ttft == [pytest.approx(100.0)]  # the online request's own, not the queued jobs'


def test_live_metrics_leave_offline_out_of_latency_and_completions():
    m = LiveMetrics("g", start_s=0.0)
    m.record_finished(0.1, 0.02, 0.5)
    m.record_finished(30.0, 0.05, 60.0, PRIORITY_OFFLINE)
    s = m.sample(2.0, queue_length=0, running=0, kv_blocks_used=0, kv_blocks_total=10, micro_batches_sent=0, stages=[])
    assert s.completed == 1 and s.ttft_p99_ms == pytest.approx(100.0)


def _share(backlog: OfflineBacklog, until_s: float = 1e9, per_step: int = 8, **tide) -> OfflineShare:
    return OfflineShare(backlog, TideConfig(hysteresis_samples=1, **tide), horizon_s=0.0, until_s=until_s,
                        seats_fraction=0.5, per_step=per_step)


def test_the_gate_admits_in_troughs_up_to_half_the_seats_and_pauses_on_rises():
    gear = manual_gear([1], micro_batch_size=4, max_inflight_micro_batches=2).model_copy(update={"rps_max": 10.0})
    # 1 req/s then 9 req/s: a trough (below 50 % of rps_max 10), then a rise (above 75 %)
    online = Workload.from_requests([Request(f"a{i}", i * 1.0, 10, 1) for i in range(10)]
                                    + [Request(f"b{i}", 10.0 + i / 9, 10, 1) for i in range(90)], name="tide")
    backlog = OfflineBacklog([Request(f"job{i}", 0.0, 10, 50, "offline") for i in range(100)], cycle=True)
    share = _share(backlog, ema_alpha=1.0)
    sim = Simulator(online, gear, TIMING)
    held = []
    while not sim.finished:
        samples = sim.advance(sim.now_s + 2.0)
        if samples:
            share.step(sim, samples[-1], gear, None)
            held.append((sim.now_s, sim.offline_open))
    # half the 8 seats, times the spare share below the pause level (7.5 req/s) at 1 req/s: 4 x (1 - 1 / 7.5)
    assert max(n for _, n in held) == 3
    assert [a for _, a, _ in share.outcome.decisions][:2] == ["admit", "pause"]
    paused_at = share.outcome.decisions[1][0]
    assert all(n <= 3 for t, n in held if t > paused_at) and held[-1][1] == 0  # nothing new after the pause
    out = share.settle(sim.result())
    assert len(out.completions) == out.submitted == backlog.taken and out.put_back == 0
    assert all(c.shared for c in out.completions) and out.tokens == 60 * len(out.completions)


def test_the_budget_shrinks_with_online_load_and_the_latency_guard_holds_it():
    gear = manual_gear([1], micro_batch_size=16, max_inflight_micro_batches=1).model_copy(update={"rps_max": 10.0})
    share = OfflineShare(OfflineBacklog(_jobs(1)), TideConfig(), horizon_s=0.0, until_s=10.0, slo_ttft_ms=1000.0,
                         slo_tpot_ms=100.0, guard_fraction=0.7, seats_fraction=0.125)
    budgets = []
    for rps in (0.0, 3.75, 7.5, 9.0):
        share.ema_rps = rps
        budgets.append(share.limit(gear))
    assert budgets == [2, 1, 0, 0]  # 1/8 of 16 seats, x (1 - rps / 7.5)
    assert share.guarded() is None
    share.ema_p99_ms = {"ttft_p99_ms": 500.0, "tpot_p99_ms": 80.0}
    assert share.guarded() == "online tpot_p99 80 ms > 0.7 x SLO 100 ms"


def test_admission_ramps_per_control_step():
    gear = manual_gear([1], micro_batch_size=16, max_inflight_micro_batches=1).model_copy(update={"rps_max": 10.0})
    backlog = OfflineBacklog([Request(f"job{i}", 0.0, 10, 5000, "offline") for i in range(20)])
    share = _share(backlog, per_step=2, ema_alpha=1.0)
    sim = Simulator(_online(1, 1.0, start_s=20.0), gear, LinearStageTiming.uniform(1, prefill_fixed_ms=10,
                                                                                  decode_fixed_ms=10))
    opened = []
    for _ in range(4):
        samples = sim.advance(sim.now_s + 2.0)
        share.step(sim, samples[-1], gear, None)
        opened.append(sim.offline_open)
    assert opened == [2, 4, 6, 8]  # 2 per step up to half the 16 seats


def test_jobs_unfinished_at_the_end_of_the_day_go_back_to_the_backlog():
    gear = manual_gear([1], micro_batch_size=8, max_inflight_micro_batches=1).model_copy(update={"rps_max": 10.0})
    backlog = OfflineBacklog([Request(f"job{i}", 0.0, 10, 400, "offline") for i in range(10)])
    share = _share(backlog, until_s=5.0, ema_alpha=1.0)
    sim = Simulator(_online(3, 2.0), gear, LinearStageTiming.uniform(1, prefill_fixed_ms=10, decode_fixed_ms=10))
    while not sim.finished:
        samples = sim.advance(sim.now_s + 2.0)
        if samples:
            share.step(sim, samples[-1], gear, None)
    out = share.settle(sim.result())
    # 400 tokens at 10 ms take 4 s: jobs admitted at 2 s finish after the day's 5 s and count for nothing
    assert out.submitted == 3 and out.completions == [] and out.put_back == 3  # 4 seats x (1 - 0.5 / 7.5)
    assert len(backlog) == 10 and backlog.waiting_returned == 3
    assert [r.request_id for r in backlog.take(2)] == ["job0", "job1"]


@pytest.mark.parametrize("kw, field", [(dict(seats_fraction=0.0), "seats_fraction"), (dict(until_s=0.0), "until_s"),
                                       (dict(horizon_s=-1.0), "horizon_s"), (dict(per_step=0), "per_step")])
def test_share_refuses_bad_figures(kw, field):
    args = dict(horizon_s=0.0, until_s=10.0) | kw
    with pytest.raises(InputError, match=field):
        OfflineShare(OfflineBacklog(_jobs(1)), TideConfig(), **args)
