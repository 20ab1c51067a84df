"""Fleet gears (issue 20, items 3-4): instances planned per host shape, nested fleet gears, the fleet
scaler, the exact fleet simulator and the fluid day model checked against it."""

from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pytest

from flexpipe_dag.control.day_setting import tide_day
from flexpipe_dag.control.fleet_day import best_static, instance_changes, simulate_fleet_day
from flexpipe_dag.control.fleet_scaler import (
    MAX_DWELL_S,
    MAX_OUTAGE_HOLD_S,
    FleetScaler,
    FleetScalerConfig,
    FleetScalerState,
)
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.fleet import FleetInstance, FleetPlan, FleetSettings, host_shapes, plan_fleet
from flexpipe_dag.planner.fleet_curve import AttainmentCurve, measure_attainment_curves
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.sim.fleet import FleetSimulator, InstanceChange, attainment_after
from flexpipe_dag.workload import load_trace
from flexpipe_dag.workload.transform import speedup
from tests.support import EXAMPLES, enveloped_gear

#: The product's probe length (1,000 requests): shorter probes overstate a large-batch gear's envelope
#: (its queue builds slower than a 400-request probe lasts), and then no day model agrees with the exact one.
SETTINGS = FleetSettings()


@pytest.fixture(scope="module")
def small():
    """The shipped small fleet (2 hosts of 4 A10, 2 of 4 T4) planned for Llama-3-8B, with attainment curves."""
    cluster = load_cluster_profile(EXAMPLES / "fleet_small.yaml")
    ref = load_trace("azure-conv")
    plan = plan_fleet(cluster, load_model_spec("Llama-3-8B"), ref, settings=SETTINGS)
    curves = measure_attainment_curves(plan, ref, SETTINGS)  # the envelope's own sample size
    return cluster, plan, curves


def test_instances_are_planned_once_per_host_shape_and_ordered_by_envelope_per_device(small):
    cluster, plan, _ = small
    assert len(host_shapes(cluster)) == 2 and len(plan.templates) == 2
    assert len(plan.instances) == 4 and not plan.notes
    hosts_of = {d.device_id: d.node_id for d in cluster.devices}
    used: set[str] = set()
    for inst in plan.instances:
        assert {hosts_of[d] for d in inst.gear.device_ids} == set(inst.host_ids)  # on its own hosts
        assert not used & set(inst.gear.device_ids)                              # disjoint
        used |= set(inst.gear.device_ids)
        assert inst.rps_max == plan.templates[inst.template].rps_max > 0
    per_device = [i.rps_max / i.num_devices for i in plan.instances]
    assert per_device == sorted(per_device, reverse=True)
    assert plan.instances[0].host_ids[0].startswith("a10")  # A10s serve more per device than T4s
    assert plan.rps_max == pytest.approx(sum(i.rps_max for i in plan.instances))


def test_only_each_shapes_template_is_confirmed_and_it_beats_every_other_gears_upper_bound(small):
    """Lazy confirmation: the other gears keep their short probes' tops (upper bounds of their confirmed ones),
    so a template confirmed above every one of them per device is the one confirming them all would choose."""
    _, plan, _ = small
    for template in plan.templates:
        rows = {gear_id: (devices, rps, confirmed) for gear_id, devices, rps, confirmed in template.candidates}
        devices, rps, confirmed = rows[template.gear.gear_id]
        assert confirmed and rps == template.rps_max > 0
        assert all(other_rps / other_devices <= rps / devices for other_devices, other_rps, _ in rows.values())


def test_fleet_gears_are_nested_prefixes_sized_with_headroom(small):
    _, plan, _ = small
    first = plan.instances[0].rps_max
    assert plan.instances_for(0.0) == 0 and plan.gear_for(0.0).fleet_gear_id == "fleet-1"
    assert plan.instances_for(0.8 * first, 0.2) == 1
    assert plan.instances_for(0.81 * first, 0.2) == 2
    assert plan.instances_for(10 * plan.rps_max) == len(plan.instances)
    big, smaller = plan.gear_for(plan.rps_max * 0.7, 0.0), plan.gear_for(first * 0.5, 0.0)
    assert big.instances[:len(smaller.instances)] == smaller.instances
    assert big.rps_max == pytest.approx(sum(i.rps_max for i in big.instances))
    with pytest.raises(InputError, match="headroom_fraction"):
        plan.instances_for(1.0, 1.0)


def test_a_shape_that_cannot_serve_is_named_and_left_out():
    cluster = load_cluster_profile(EXAMPLES / "fleet_small.yaml")
    spec = load_model_spec("Llama-2-70B")  # 130 GiB of weights: no unit of these hosts within the SLO
    with pytest.raises(Exception, match="serve") as info:
        plan_fleet(cluster, spec, load_trace("azure-conv"), settings=FleetSettings(num_requests=200, max_unit_hosts=2))
    assert "a10-0" in str(info.value) and "t4-0" in str(info.value)


def test_racks_too_small_for_a_unit_are_named_as_the_reason(tmp_path):
    # one T4 per rack cannot hold Llama-3-8B; two could, but the refusal only said the model did not fit one T4
    path = tmp_path / "racks.yaml"
    path.write_text("cluster_id: r1\nfleet:\n  - {node_id: t, gpu_model: T4, count: 1, hosts: 4, hosts_per_rack: 1}\n")
    with pytest.raises(Exception, match="serve") as info:
        plan_fleet(load_cluster_profile(path), load_model_spec("Llama-3-8B"), load_trace("azure-conv"),
                   settings=FleetSettings(num_requests=200))
    assert "2 host(s): no rack holds 2 of these hosts" in str(info.value)


def test_hosts_leaving_at_different_times_share_a_shape_unless_they_leave_within_the_residence(tmp_path):
    # spot hosts each with their own end time were each a shape of their own (one plan per date: 8 A10
    # hosts with 8 dates planned in 57 s against 7.5 s); the planner only asks whether a device stays for
    # its minimum residence (600 s), so that is all the shape holds
    now = dt.datetime.now(dt.UTC)

    def at(minutes: float) -> str:
        return (now + dt.timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")

    lines = ["cluster_id: spot", "fleet:"]
    lines += [f"  - {{node_id: s{i}, gpu_model: A10, count: 4, available_until: {at(60 * (i + 1))}}}" for i in range(8)]
    lines.append(f"  - {{node_id: soon, gpu_model: A10, count: 4, available_until: {at(5)}}}")  # < 600 s from now
    path = tmp_path / "spot.yaml"
    path.write_text("\n".join(lines) + "\n")
    shapes = list(host_shapes(load_cluster_profile(path)).values())
    assert sorted(map(len, shapes)) == [1, 8] and ["soon"] in shapes


def test_fleet_envelope_holds_in_the_exact_fleet_simulator(small):
    """The promise: all instances behind the router at 80 % of the summed envelope keep >= 90 % attainment."""
    _, plan, _ = small
    ref = load_trace("azure-conv")
    work = ref if len(ref) <= 1500 else type(ref)(name=ref.name, requests=ref.requests[:1500])
    work = speedup(work, 0.8 * plan.rps_max / work.mean_rate_rps)
    changes = [InstanceChange(0.0, "add", i.instance_id, i.gear, plan.templates[i.template].timing)
               for i in plan.instances]
    result = FleetSimulator(SimConfig(slo_ttft_ms=SETTINGS.slo_ttft_ms, slo_tpot_ms=SETTINGS.slo_tpot_ms)).run(work, changes)
    assert result.lost == 0
    assert attainment_after(result, 0.25 * work.duration_s) >= 0.9
    served = result.requests.groupby("instance_id").size()
    assert set(served.index) == {i.instance_id for i in plan.instances}  # every instance takes work
    big, tiny = plan.instances[0].instance_id, plan.instances[-1].instance_id
    assert served[big] > served[tiny]  # in proportion to capacity, not round robin


def test_removing_an_instance_under_load_loses_nothing(small):
    _, plan, _ = small
    work = load_trace("azure-conv")
    work = type(work)(name=work.name, requests=work.requests[:600])
    work = speedup(work, 0.5 * plan.rps_max / work.mean_rate_rps)
    mid = work.requests[300].arrival_s
    a, b = plan.instances[0], plan.instances[1]
    changes = [InstanceChange(0.0, "add", a.instance_id, a.gear, plan.templates[a.template].timing),
               InstanceChange(0.0, "add", b.instance_id, b.gear, plan.templates[b.template].timing),
               InstanceChange(mid, "remove", b.instance_id)]
    result = FleetSimulator(SimConfig(slo_ttft_ms=2000.0, slo_tpot_ms=200.0)).run(work, changes)
    assert result.lost == 0 and len(result.requests) == 600
    assert result.requests["request_id"].is_unique
    on_b = result.requests[result.requests["instance_id"] == b.instance_id]
    assert len(on_b) > 0 and on_b["arrival_s"].max() < mid  # nothing routed to it after removal
    row = result.instances.set_index("instance_id").loc[b.instance_id]
    assert row["held_until_s"] == pytest.approx(max(mid, on_b["finish_s"].max()))  # held while draining


@pytest.mark.parametrize("headroom, scale_in_headroom", [(0.2, 0.3), (0.05, 0.15)])
def test_fluid_day_model_agrees_with_the_exact_fleet_simulator(small, headroom, scale_in_headroom):
    """The same compressed tide day and the same scaler decisions, played by the window model and request
    by request: attainment within 3 points, device-hours within 5 %, and the exact run loses nothing.
    At 5 % headroom this 4-instance fleet runs at its edge: queues build and are carried across windows."""
    _, plan, curves = small
    duration_s, window_s = 3600.0, 30.0
    work = tide_day(start_day=1, duration_s=duration_s, peak_rps=0.8 * plan.rps_max)
    arrivals = np.array([r.arrival_s for r in work.requests])
    rates = np.bincount((arrivals // window_s).astype(int), minlength=int(duration_s // window_s))
    rates = rates[:int(duration_s // window_s)] / window_s
    cfg = FleetScalerConfig(sample_period_s=window_s, dwell_s=300, scale_out_dwell_s=60, instance_warmup_s=30,
                            instance_drain_s=15, forecast_horizon_s=0, headroom_fraction=headroom,
                            scale_in_headroom_fraction=scale_in_headroom)
    day = simulate_fleet_day(plan, curves, rates, window_s=window_s, scaler_config=cfg, settings=SETTINGS)
    assert day.decisions and all(d.reason for d in day.decisions)
    changes = instance_changes(plan, day, warmup_s=cfg.instance_warmup_s)
    exact = FleetSimulator(SimConfig(slo_ttft_ms=SETTINGS.slo_ttft_ms, slo_tpot_ms=SETTINGS.slo_tpot_ms)).run(work, changes)
    assert exact.lost == 0
    assert abs(exact.slo_attainment() - day.slo_attainment) <= 0.03
    held_exact = exact.instances.assign(held=lambda f: np.minimum(f["held_until_s"], duration_s) - f["added_s"])
    device_hours_exact = float((held_exact["held"].clip(lower=0) * held_exact["devices"]).sum() / 3600.0)
    assert device_hours_exact == pytest.approx(day.device_hours, rel=0.05)
    static = best_static(plan, curves, rates, attainment=day.slo_attainment, window_s=window_s, settings=SETTINGS)
    # the fewest static instances reaching the dynamic day's attainment, or the whole plan when none does (a
    # plan's last instances can miss the SLO even at low load, and the scaler may never start them)
    assert static.policy.startswith("static-")
    assert static.slo_attainment >= day.slo_attainment or static.policy == f"static-{len(plan.instances)}"


def test_a_backlog_is_carried_across_windows(small):
    """An overload the fleet cannot serve builds a queue that makes the next (light) windows late too."""
    _, plan, curves = small
    one = plan.instances[0].rps_max
    over = simulate_fleet_day(plan, curves, [2.0 * one] * 4 + [0.2 * one] * 8, window_s=60.0, static_instances=1,
                              settings=SETTINGS)
    assert over.attainment[:4].max() < 0.5
    assert over.attainment[4] < 0.5          # the first light window still waits behind the queue
    assert over.attainment[-1] > 0.9         # and the queue drains


# ---------------------------------------------------------------------------------------------- scaler


def _plan(envelopes: list[float]) -> FleetPlan:
    instances = tuple(FleetInstance(instance_id=f"i{k}", host_ids=(f"h{k}",),
                                    gear=enveloped_gear(f"i{k}", "throughput", 0.0, rps, 1), template=0)
                      for k, rps in enumerate(envelopes))
    return FleetPlan(cluster_id="fake", templates=(), instances=instances)


def test_the_bound_holds_the_fewest_instances_each_window_at_their_envelopes():
    from flexpipe_dag.control.fleet_day import bound_device_hours

    plan = _plan([10.0, 10.0, 10.0])
    d = plan.instances[0].num_devices
    # hour by hour: 5 req/s -> 1 instance, 15 -> 2, 25 -> 3, 0 -> none (no headroom, no warm-up)
    assert bound_device_hours(plan, [5.0, 15.0, 25.0, 0.0], window_s=3600.0) == pytest.approx(6.0 * d)
    # at 10 % headroom 9.5 req/s needs 2 instances (9.5 / 0.9 > 10), 25 still 3 (25 / 0.9 < 30)
    assert bound_device_hours(plan, [9.5, 25.0], window_s=3600.0, headroom_fraction=0.1) == pytest.approx(5.0 * d)


def test_scaler_scales_out_after_hysteresis_and_in_after_dwell_and_payback():
    plan = _plan([10.0, 10.0, 10.0, 10.0])
    cfg = FleetScalerConfig(sample_period_s=60, rps_ema_alpha=1.0, hysteresis_samples=2, scale_out_samples=2,
                            dwell_s=600, forecast_horizon_s=0, headroom_fraction=0.2, trend_beta=0.0,
                            scale_in_headroom_fraction=0.3, overload_samples=3, scale_in_max_fraction=1.0)
    scaler = FleetScaler(plan, cfg)
    st = scaler.initial_state(5.0)
    assert st.instances == 1
    st, d = scaler.decide(st, 60, 25.0)
    assert not d.changed and d.reason_kind == "hold"          # one sample is not enough
    st, d = scaler.decide(st, 120, 25.0)
    assert (d.from_instances, d.to_instances, d.reason_kind) == (1, 4, "scale_out")  # 25 / 0.8 = 31.25 > 30
    st, d = scaler.decide(st, 180, 5.0)
    st, d = scaler.decide(st, 240, 5.0)
    assert not d.changed and d.reason_kind == "dwell" and "600" in d.reason
    st, d = scaler.decide(st, 780, 5.0)
    assert (d.to_instances, d.reason_kind) == (1, "scale_in") and "drain + warm-up" in d.reason


def test_scaler_scales_out_at_once_on_an_overload():
    """Traffic back after a lull: the raw rate above the whole envelope scales out on the first sample, sized
    for the raw rate (the EMA would still read half of it)."""
    plan = _plan([10.0] * 6)
    scaler = FleetScaler(plan, FleetScalerConfig(rps_ema_alpha=0.5, scale_out_samples=3, forecast_horizon_s=0,
                                                 trend_beta=0.0, scale_out_dwell_s=120))
    st = scaler.initial_state(0.0)
    st, d = scaler.decide(st, 60, 0.0)
    st, d = scaler.decide(st, 120, 40.0)
    assert (d.to_instances, d.reason_kind) == (5, "scale_out") and "overloaded" in d.reason  # 40 / 0.95 > 40
    st, d = scaler.decide(st, 130, 55.0)                 # overloaded again within the scale-out dwell: wait
    assert not d.changed and d.reason_kind == "dwell"
    # a queue left by the surge is load too: 30 req/s arriving + 9,000 queued / 300 s = 60 req/s: overloaded
    st, d = scaler.decide(st, 300, 30.0, queued=9000.0)
    assert d.to_instances == 6 and "9000 queued" in d.reason
    with pytest.raises(InputError, match="queued"):
        scaler.decide(st, 360, 1.0, queued=-1.0)


def test_scaler_sizes_a_rising_load_for_when_new_instances_serve():
    """On a ramp the scaler orders the instances the load will need once they have warmed up (Holt's trend x
    (warm-up + one sample)), not those the smoothed rate needs now: a fleet sized for now is a warm-up behind."""
    plan = _plan([10.0] * 20)
    cfg = FleetScalerConfig(sample_period_s=60, instance_warmup_s=120, headroom_fraction=0.0,
                            scale_in_headroom_fraction=0.1, forecast_horizon_s=0)
    trend = FleetScaler(plan, cfg)
    level = FleetScaler(plan, cfg.model_copy(update={"trend_beta": 0.0}))
    st_t, st_l = trend.initial_state(20.0), level.initial_state(20.0)
    for k in range(1, 9):                                 # +5 req/s per minute
        rate = 20.0 + 5.0 * k
        st_t, d_t = trend.decide(st_t, 60.0 * k, rate)
        st_l, d_l = level.decide(st_l, 60.0 * k, rate)
    assert st_t.trend_rps_per_s * 60 == pytest.approx(5.0, rel=0.1)
    assert "rising" in d_t.reason or "rising" in trend.decide(st_t, 540.0, 65.0)[1].reason
    ahead = 60.0 + 5.0 * 3                                # the rate 3 minutes after the last sample (60 req/s)
    assert trend.capacity_rps(st_t.instances) >= ahead > level.capacity_rps(st_l.instances)
    # a falling load is not extrapolated: the scale-in target holds the smoothed rate, not a projection below it
    st, d = trend.decide(st_t, 600.0, 30.0)
    assert trend.capacity_rps(st.instances) >= st.ema_rps


def test_a_scale_out_is_sized_for_the_latest_rate_but_only_the_smoothed_one_triggers_it():
    """On a ramp's onset the latest sample is above the smoothed rate: a scale-out the smoothed load asks for is
    sized for the latest rate (one warm-up sooner); a sample above the trigger while the smoothed load is not does
    nothing (a noisy sample cannot order instances)."""
    plan = _plan([10.0] * 20)
    cfg = FleetScalerConfig(sample_period_s=60, rps_ema_alpha=0.5, trend_beta=0.0, headroom_fraction=0.3,
                            scale_in_headroom_fraction=0.4, forecast_horizon_s=0)
    scaler = FleetScaler(plan, cfg)
    start, _ = scaler.decide(scaler.initial_state(30.0), 0, 30.0)   # 30 / 0.7 -> 5 instances, 50 req/s
    assert start.instances == 5 and start.ema_rps == 30.0
    st, d = scaler.decide(start, 60, 49.0)              # smoothed 39.5 / 0.7 = 56 -> 6 asked; 49 / 0.7 = 70 -> 7
    assert (d.to_instances, d.reason_kind) == (7, "scale_out") and st.ema_rps == pytest.approx(39.5)
    st, d = scaler.decide(start, 60, 39.0)              # smoothed 34.5 / 0.7 = 49.3: the 5 hold it; 39 alone would not
    assert not d.changed and d.reason_kind == "hold"


def test_scaler_scale_in_lands_in_the_middle_of_the_band():
    """Scale-in is triggered below the scale-in headroom (here 30 %) and lands at the middle of the band (20 %):
    the fewest instances holding the load at 80 % of their envelope, not at 70 %."""
    plan = _plan([10.0] * 10)
    cfg = FleetScalerConfig(sample_period_s=60, rps_ema_alpha=1.0, hysteresis_samples=1, dwell_s=60, trend_beta=0.0,
                            forecast_horizon_s=0, instance_warmup_s=0, instance_drain_s=0, payback_factor=0.0,
                            headroom_fraction=0.1, scale_in_headroom_fraction=0.3, scale_in_max_fraction=1.0)
    scaler = FleetScaler(plan, cfg)
    st = scaler.initial_state(90.0)
    assert st.instances == 10
    st, d = scaler.decide(st, 60, 40.0)        # 40 / 0.7 = 57 -> 6 would hold at 30 %; 40 / 0.8 = 50 -> 5 at 20 %
    assert (d.to_instances, d.reason_kind) == (5, "scale_in") and "20%" in d.reason
    st, d = scaler.decide(st, 180, 44.0)       # 44 / 50 = 88 %: inside the band, neither rule
    assert not d.changed


def _vanishing_config(outage_hold_s: float) -> FleetScalerConfig:
    """Raw rates (no smoothing or trend), one sample to scale in, a 300-s dwell, scale-ins free to pay back."""
    return FleetScalerConfig(sample_period_s=60, rps_ema_alpha=1.0, hysteresis_samples=1, dwell_s=300, trend_beta=0.0,
                             forecast_horizon_s=0, instance_warmup_s=0, instance_drain_s=0, payback_factor=0.0,
                             outage_hold_s=outage_hold_s)


def test_scaler_gives_back_at_most_a_third_of_the_envelope_per_scale_in_when_traffic_vanishes():
    """An outage (the rate drops to 0) is not a tide: one scale-in keeps two thirds of the envelope, the next
    (a dwell later) two thirds of that; a fleet of two still gives one instance back (here with no outage hold:
    the next test has it)."""
    plan, cfg = _plan([10.0] * 12), _vanishing_config(outage_hold_s=0.0)
    scaler = FleetScaler(plan, cfg)
    st = scaler.initial_state(100.0)
    assert st.instances == 12
    st, d = scaler.decide(st, 60, 0.0)
    assert (d.to_instances, d.reason_kind) == (8, "scale_in") and "at most 33% of the envelope" in d.reason
    st, d = scaler.decide(st, 120, 0.0)
    assert d.reason_kind == "dwell"
    st, d = scaler.decide(st, 360, 0.0)
    assert d.to_instances == 6                                   # ceil(2/3 x 80 / 10)
    unlimited = FleetScaler(plan, cfg.model_copy(update={"scale_in_max_fraction": 1.0}))
    assert unlimited.decide(unlimited.initial_state(100.0), 60, 0.0)[1].to_instances == 1
    pair = FleetScaler(_plan([10.0, 10.0]), cfg)
    assert pair.decide(pair.initial_state(15.0), 60, 0.0)[1].to_instances == 1


def test_scaler_holds_its_instances_through_an_outage_then_gives_back_a_third_per_dwell():
    """Traffic that vanishes (the raw rate under 10 % of the envelope) comes back at its level: scale-ins wait out
    ``outage_hold_s``; a return at a lower level is scaled in to as soon as it is seen; after the hold the fleet is
    given back a third per dwell as without it."""
    plan, cfg = _plan([10.0] * 12), _vanishing_config(outage_hold_s=1800.0)
    scaler = FleetScaler(plan, cfg)
    start = scaler.initial_state(100.0)
    st, d = scaler.decide(start, 60, 0.0)
    assert (d.changed, d.reason_kind) == (False, "outage") and "an outage for 0 s" in d.reason, d.reason
    st, d = scaler.decide(st, 1200, 0.0)
    assert (d.changed, d.reason_kind) == (False, "outage") and "for 1140 s" in d.reason
    st, d = scaler.decide(st, 1860, 0.0)                 # held 1,800 s: a third of the envelope goes back
    assert (d.to_instances, d.reason_kind) == (8, "scale_in") and st.outage_since_s == 60
    # the traffic returns at its level within the hold: nothing was given back, nothing to order
    st, d = scaler.decide(scaler.decide(start, 60, 0.0)[0], 600, 95.0)
    assert not d.changed and st.outage_since_s is None and st.instances == 12
    # it returns at half its level: that is a load like any other, scaled in to once seen
    st, d = scaler.decide(scaler.decide(start, 60, 0.0)[0], 600, 50.0)
    assert (d.to_instances, d.reason_kind) == (8, "scale_in")
    no_hold = FleetScaler(plan, cfg.model_copy(update={"outage_hold_s": 0.0}))
    assert no_hold.decide(no_hold.initial_state(100.0), 60, 0.0)[1].to_instances == 8


def test_a_reading_soon_after_the_last_is_no_surge_and_samples_out_of_order_or_absurd_rates_are_refused():
    """30 -> 31 req/s one millisecond later used to read as a trend of +1,000 req/s per s and scale a fleet of 4
    out to all 12; a sample before the last one's time made an outage (and a dwell) of negative seconds; a rate
    of 1e300 req/s was smoothed and printed with 300 digits."""
    scaler = FleetScaler(_plan([10.0] * 12), FleetScalerConfig())
    st, _ = scaler.decide(scaler.initial_state(30.0), 60, 30.0)
    assert st.instances == 4
    st, d = scaler.decide(st, 60.001, 31.0)
    assert not d.changed and d.reason_kind == "hold", d.reason
    with pytest.raises(InputError, match="t_s: got 0, before the last sample's 60.001 s; expected samples in time"):
        scaler.decide(st, 0.0, 30.0)
    assert not scaler.decide(st, 60.001, 30.0)[1].changed          # the same time again is a sample, not an error
    for field, kwargs in (("rps", {"rps": 1e300}), ("queued", {"rps": 30.0, "queued": 1e300})):
        with pytest.raises(InputError, match=f"fleet scaler: {field}: expected a finite number >= 0 and <= 1e"):
            scaler.decide(st, 120, **kwargs)


def test_a_tide_falling_to_its_trough_is_not_an_outage_and_the_smoothed_rate_stays_non_negative():
    """A tide falls by at most a third of its rate in a dwell and the scaler follows it down, so the rate stays
    well above 10 % of the envelope and no scale-in waits for an outage; Holt's level of a rate that falls to
    0 stays >= 0 (a negative level used to make the tide forecast fail on the way)."""
    plan = _plan([10.0] * 12)
    scaler = FleetScaler(plan, FleetScalerConfig(sample_period_s=60, dwell_s=300, forecast_horizon_s=0,
                                                 instance_warmup_s=0, instance_drain_s=0))
    st, kinds = scaler.initial_state(100.0), []
    for k in range(1, 101):                              # -3 % a minute: 100 -> 4.8 req/s over 100 minutes
        st, d = scaler.decide(st, 60.0 * k, 100.0 * 0.97 ** k)
        kinds.append(d.reason_kind)
    assert "outage" not in kinds and kinds.count("scale_in") >= 5 and st.instances <= 2
    falling = FleetScaler(plan, FleetScalerConfig())
    st = falling.initial_state(100.0)
    for k, rate in enumerate([100.0, 60.0, 20.0, 0.0, 0.0, 0.0, 0.0], start=1):
        st, d = falling.decide(st, 60.0 * k, rate)
        assert st.ema_rps >= 0.0 and "smoothed -" not in d.reason


def test_scaler_declines_a_scale_in_the_forecast_says_will_not_pay_back():
    plan = _plan([10.0, 10.0])
    cfg = FleetScalerConfig(sample_period_s=60, rps_ema_alpha=1.0, hysteresis_samples=1, dwell_s=0,
                            forecast_horizon_s=1800, instance_warmup_s=120, instance_drain_s=60,
                            headroom_fraction=0.2, scale_in_headroom_fraction=0.3)
    scaler = FleetScaler(plan, cfg)
    st = scaler.initial_state(15.0)

    def rise_soon(t_s: float, rps: float, horizon_s: float) -> float:   # load returns within 2 min
        return rps if horizon_s < 120 else 15.0

    def stays_low(t_s: float, rps: float, horizon_s: float) -> float:
        return rps

    cfg_no_lookahead = cfg.model_copy(update={"scale_in_headroom_fraction": 0.3})
    # the forecast max over the horizon includes the rise, so scale-in is not even wanted
    _, d = FleetScaler(plan, cfg_no_lookahead).decide(st, 60, 2.0, rise_soon)
    assert not d.changed
    # a forecast that is low over the whole horizon: scale in, with the expected residence in the reason
    _, d = scaler.decide(st, 60, 2.0, stays_low)
    assert d.to_instances == 1 and "1800 s" in d.reason
    # without a forecast the expected residence is one dwell: 0 s here, below 180 s of drain + warm-up
    _, d = scaler.decide(st, 60, 2.0)
    assert not d.changed and d.reason_kind == "payback"


def test_scaler_ignores_a_failing_forecast_and_says_so():
    scaler = FleetScaler(_plan([10.0, 10.0]), FleetScalerConfig(forecast_horizon_s=600))
    st = scaler.initial_state(5.0)

    def broken(t_s: float, rps: float, horizon_s: float) -> float:
        raise ZeroDivisionError("division by zero")

    for forecast, said in ((broken, "raised ZeroDivisionError"), (lambda *_: None, "raised TypeError"),
                           (lambda *_: float("inf"), "returned inf"), (lambda *_: -5.0, "returned -5.0")):
        _, d = scaler.decide(st, 60, 5.0, forecast)
        assert not d.changed and f"forecast ignored: the forecast {said}" in d.reason


def test_fleet_plan_and_settings_refuse_bad_values():
    plan = _plan([10.0, 10.0])
    for bad in (1.5, True, -1, 3):
        with pytest.raises(InputError, match="num_instances"):
            plan.prefix(bad)
    with pytest.raises(InputError, match="rps"):
        plan.instances_for(math.nan)
    for field, value in (("attainment", 0.0), ("attainment", 2.0), ("num_requests", 1), ("max_unit_hosts", True),
                         ("max_unit_hosts", 1.5), ("slo_ttft_ms", math.nan), ("concurrency", 0),
                         ("context_p95_tokens", 2.5)):
        with pytest.raises(InputError, match=field):
            FleetSettings(**{field: value})
    scaler = FleetScaler(plan)
    with pytest.raises(InputError, match="config"):
        FleetScaler(plan, {"headroom_fraction": 0.1})
    with pytest.raises(InputError, match="state.instances"):
        scaler.decide(type(scaler.initial_state(1.0))(instances=-3), 0.0, 1.0)
    with pytest.raises(InputError, match="t_s"):
        scaler.decide(scaler.initial_state(1.0), math.nan, 1.0)


def test_a_hand_built_scaler_state_is_checked_and_the_states_the_scaler_makes_pass():
    """instances=2.5 used to raise a raw TypeError in decide (a list index) and ema_rps=-50 was smoothed as given;
    the scaler's own states (a falling trend is negative, 'never' is -inf) and numpy numbers still pass."""
    for field, value, expected in (("instances", 2.5, "an integer >= 0"), ("instances", True, "an integer >= 0"),
                                   ("instances", -1, "an integer >= 0"), ("in_count", 1.0, "an integer >= 0"),
                                   ("ema_rps", -50.0, "a finite number >= 0 \\(req/s\\)"),
                                   ("ema_rps", math.nan, "a finite number >= 0"),
                                   ("trend_rps_per_s", math.inf, "a finite number \\(req/s per s\\)"),
                                   ("last_sample_s", "60", "a finite number"),
                                   ("outage_since_s", -math.inf, "a finite number"),
                                   ("last_change_s", math.inf, "a finite number \\(s; or -inf: never\\)"),
                                   ("last_out_s", math.nan, "a finite number")):
        with pytest.raises(InputError, match=f"^fleet scaler: state.{field}: expected {expected}"):
            FleetScalerState(**{"instances": 2, field: value})
    scaler = FleetScaler(_plan([10.0] * 12), FleetScalerConfig())
    st = scaler.initial_state(100.0)
    for k, rate in enumerate([100.0, 60.0, 20.0, 0.0], start=1):
        st, _ = scaler.decide(st, 60.0 * k, rate)
    assert st.trend_rps_per_s < 0 and st.last_out_s == -math.inf
    assert FleetScalerState(instances=np.int64(2), ema_rps=np.float64(3.0), last_sample_s=-5).instances == 2


def test_scaler_refuses_bad_figures():
    with pytest.raises(ValueError, match="scale_in_headroom_fraction"):
        FleetScalerConfig(headroom_fraction=0.3, scale_in_headroom_fraction=0.1)
    # numbers are strict (pydantic's lax mode read "0.5" as 0.5 and 2.0 as a count of 2); an int is a float
    for field, value, expected in (("rps_ema_alpha", "0.5", "a valid number"), ("dwell_s", "600", "a valid number"),
                                   ("hysteresis_samples", "2", "a valid integer"),
                                   ("hysteresis_samples", 2.0, "a valid integer")):
        with pytest.raises(ValueError, match=f"{field}\n  Input should be {expected}"):
            FleetScalerConfig(**{field: value})
    assert FleetScalerConfig(dwell_s=600, rps_ema_alpha=1).dwell_s == 600.0
    # the outage hold has the bound of `flexpipe serve --scale-outage-hold-s` (it took up to 1e9 s)
    assert FleetScalerConfig(outage_hold_s=MAX_OUTAGE_HOLD_S).outage_hold_s == MAX_OUTAGE_HOLD_S == 86400
    with pytest.raises(ValueError, match="outage_hold_s\n  Input should be less than or equal to 86400"):
        FleetScalerConfig(outage_hold_s=MAX_OUTAGE_HOLD_S + 1)
    # so has the dwell that of `--scale-dwell-s`
    assert FleetScalerConfig(dwell_s=MAX_DWELL_S).dwell_s == MAX_DWELL_S == 86400
    with pytest.raises(ValueError, match="dwell_s\n  Input should be less than or equal to 86400"):
        FleetScalerConfig(dwell_s=1e9)
    scaler = FleetScaler(_plan([1.0]))
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(InputError, match="rps"):
            scaler.decide(scaler.initial_state(0.5), 0.0, bad)


def test_attainment_curve_reads_between_and_beyond_its_points():
    curve = AttainmentCurve(load_fractions=np.array([0.5, 1.0, 2.0]), attainment=np.array([1.0, 0.9, 0.4]), rps_max=10.0)
    assert curve.at(0.1) == pytest.approx(1.0)
    assert curve.at(0.75) == pytest.approx(0.95)
    assert curve.at(4.0) == pytest.approx(0.2)


def test_fluid_day_refuses_bad_input(small):
    _, plan, curves = small
    with pytest.raises(InputError, match="rates_rps"):
        simulate_fleet_day(plan, curves, [1.0, -1.0])
    with pytest.raises(InputError, match="curves"):
        simulate_fleet_day(plan, {}, [1.0])
    with pytest.raises(InputError, match="static_instances"):
        simulate_fleet_day(plan, curves, [1.0], static_instances=99)


# ---------------------------------------------------------------------------------------------- command line


def test_fleet_command_prints_instances_and_the_fleet_gear_for_a_load(capsys):
    import json

    from flexpipe_dag.cli import main

    assert main(["fleet", "--cluster", str(EXAMPLES / "fleet_small.yaml"), "--model", "Llama-3-8B", "--load-rps", "1.5",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_instances"] == 4 and len(out["instances"]) == 4 and len(out["templates"]) == 2
    gear = out["fleet_gear"]
    assert gear["holds"] and gear["rps_max"] * (1 - gear["headroom"]) >= 1.5
    assert [i["instance_id"] for i in gear["instances"]][0].startswith("a10")
    # a load the whole fleet does not hold: said, and exit status 1 (a script can tell)
    assert main(["fleet", "--cluster", str(EXAMPLES / "fleet_small.yaml"), "--model", "Llama-3-8B", "--load-rps",
                 "100000", "--json"]) == 1
    said = capsys.readouterr()
    assert not json.loads(said.out)["fleet_gear"]["holds"]
    assert said.err.startswith("flexpipe fleet: infeasible: 100000 req/s exceeds what all 4 instances hold")


@pytest.mark.parametrize("flags, field", [(["--headroom", "0.95", "--day", "1"], "--headroom"), (["--day", "14"], "--day"),
                                          (["--headroom", "0.1"], "--headroom"), (["--peak-share", "0.5"], "--peak-share"),
                                          (["--slo-ttft-ms", "0"], "--slo-ttft-ms"), (["--load-rps", "-1"], "--load-rps")])
def test_fleet_command_refuses_bad_flags(capsys, flags, field):
    from flexpipe_dag.cli import main

    assert main(["fleet", "--cluster", str(EXAMPLES / "fleet_small.yaml"), "--model", "Llama-3-8B", *flags]) == 2
    assert field in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- live controller


class _FakeFleet:
    """Stands in for InstanceFleet: counts accepted requests, records adds / removes, fails a chosen gear."""

    def __init__(self, fail_gear: str | None = None):
        from types import SimpleNamespace

        self.accepted = 0
        self.open = 0
        self.router = SimpleNamespace(ledger=SimpleNamespace(counts=lambda: {
            "held": 0, "pending": 0, "finished": self.accepted, "refused": 0, "failed": 0, "cancelled": 0, "moved": 7},
            num_open=lambda: self.open))
        self.fail_gear, self.added, self.removed = fail_gear, [], []

    def add_instance(self, gear, options=None):
        from flexpipe_dag.core.errors import FlexPipeError

        if gear.gear_id == self.fail_gear:
            raise FlexPipeError(f"{gear.gear_id} did not warm up")
        self.added.append(gear.gear_id)
        return f"lane-{gear.gear_id}"

    def remove_instance(self, instance_id, drain_timeout_s=None):
        self.removed.append(instance_id)


def test_live_controller_measures_the_rate_and_keeps_serving_when_a_start_fails():
    from flexpipe_dag.shift.fleet_control import FleetController

    clock = [0.0]
    cfg = FleetScalerConfig(sample_period_s=1, rps_ema_alpha=1.0, hysteresis_samples=1, dwell_s=1, scale_out_dwell_s=0,
                            forecast_horizon_s=0, payback_factor=0.0)
    fleet = _FakeFleet(fail_gear="i2")
    ctl = FleetController(fleet, _plan([10.0, 10.0, 10.0]), cfg, clock=lambda: clock[0])
    assert ctl.start(5.0) == ["lane-i0"]
    fleet.accepted, clock[0] = 150, 10.0                     # 150 requests in 10 s: 15 req/s
    assert ctl.observed_rps() == pytest.approx(15.0)
    fleet.accepted, clock[0] = 400, 20.0
    d = ctl.step()                                           # 25 req/s: wants 3, the third fails to start
    assert d.to_instances == 3 and ctl.lane_ids == ["lane-i0", "lane-i1"] and ctl.state.instances == 2
    assert ctl.errors and "i2 did not warm up" in ctl.errors[0]
    fleet.accepted, clock[0] = 430, 30.0
    d = ctl.step()                                           # 3 req/s: back to one, the last one drains
    assert d.to_instances == 1 and fleet.removed == ["lane-i1"] and ctl.lane_ids == ["lane-i0"]
    fleet.open = 8 + 50                                      # the one instance runs 8 at once: 50 queued
    assert ctl.queued() == 50


def test_fleet_day_asset_materialises_with_a_plot(tmp_path, monkeypatch):
    from dagster import materialize

    from flexpipe_dag.assets.fleet import fleet_day
    from flexpipe_dag.resources.planning import PlanningSettings
    from flexpipe_dag.resources.store_resource import StoreResource

    monkeypatch.setenv("FLEXPIPE_HOME", str(tmp_path / "home"))
    config = {"cluster_file": str(EXAMPLES / "fleet_small.yaml"), "start_day": 1, "envelope_requests": 300}
    result = materialize([fleet_day], resources={"store": StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}"),
                                                 "planning": PlanningSettings(model="Llama-3-8B")},
                         run_config={"ops": {"fleet_day": {"config": config}}})
    assert result.success
    meta = result.asset_materializations_for_node("fleet_day")[0].metadata
    assert meta["instances"].value == 4
    assert meta["fleet_day_devices_per_hour"].value.startswith("![fleet_day_devices_per_hour](data:image/png;base64,")
    assert 0 < meta["device_hours_vs_best_static"].value <= 1.5
    assert 0 < meta["bound_vs_best_static"].value <= 1.5
    assert "static-" in meta["policies"].value


def test_without_a_topology_units_with_other_links_are_planned_on_their_own():
    """Explicit links only: hosts of equal devices share a shape, the template is reused where a unit's links
    equal the template unit's, and a unit with slower links gets a plan of its own."""
    from flexpipe_dag.core.cluster import ClusterProfile, Link

    fleet = load_cluster_profile(EXAMPLES / "fleet_small.yaml")
    devices = [d for d in fleet.devices if d.node_id.startswith("a10")]
    a10_hosts = sorted({d.node_id for d in devices})
    links = []
    for a in devices:
        for b in devices:
            if a.device_id != b.device_id and a.node_id == b.node_id:
                slow = a.node_id == a10_hosts[-1]
                links.append(Link(src_device_id=a.device_id, dst_device_id=b.device_id,
                                  bandwidth_gbps=0.5 if slow else 32.0, latency_us=500.0 if slow else 5.0))
    cluster = ClusterProfile(cluster_id="a10-links", devices=devices, links=links)
    assert len(host_shapes(cluster)) == 1
    plan = plan_fleet(cluster, load_model_spec("Llama-3-8B"), load_trace("azure-conv"), settings=SETTINGS)
    assert len(plan.instances) == 2 and len(plan.templates) == 2
    assert {i.template for i in plan.instances} == {0, 1}
