"""The mixed day (issue 18): reservation accounting, offline work on free devices, the three policies,
``flexpipe simulate --day`` and the ``mixed_day`` asset."""

from __future__ import annotations

import json

import pytest

from flexpipe_dag.control import Controller
from flexpipe_dag.control.day_setting import OperatingGears, tide_day
from flexpipe_dag.control.mixed_day import DaySetting, free_segments, goals, reservation_curve, run_mixed_day
from flexpipe_dag.control.offline_fill import OfflineBacklog, OfflinePlanner, merge_segments, run_offline, sub_cluster
from flexpipe_dag.control.replay import replay_controller_config
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.gears import make_search, plan_gear_set
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.sim import SimConfig
from flexpipe_dag.sim.device_hours import DeviceSpan
from flexpipe_dag.workload.request import Request, Workload
from tests.support import EXAMPLES

MODEL = "SmolLM2-135M"


def _jobs(n: int, prefix: str = "job") -> Workload:
    """``n`` offline jobs with prompt 100 + 10 i and output 10 + i tokens (all fit any context)."""
    return Workload.from_requests([Request(f"{prefix}{i}", 0.0, 100 + 10 * i, 10 + i, "offline") for i in range(n)],
                                  name="jobs")


@pytest.fixture(scope="module")
def lab():
    cluster = load_cluster_profile(EXAMPLES / "fragmented_lab.yaml")
    spec = load_model_spec(MODEL)
    gear_set = plan_gear_set(cluster, spec)
    cm = make_search(cluster, spec).cm
    gears = OperatingGears(list(gear_set.gears), {g.gear_id: cm.timings(g) for g in gear_set.gears}, [])
    return cluster, spec, gears


def _span(a: float, b: float, *ids: str) -> DeviceSpan:
    return DeviceSpan(a, b, frozenset(ids))


# -- reservation accounting ---------------------------------------------------------------------
def test_reservation_curve_is_mean_devices_per_hour_bin():
    spans = [_span(0, 1800, "a", "b", "c", "d"), _span(1800, 2700, "a", "b"), _span(2700, 3600, "a")]
    assert reservation_curve(spans, 3600.0, bins=2) == [4.0, 1.5]
    assert reservation_curve(spans, 3600.0, bins=4) == [4.0, 4.0, 2.0, 1.0]
    # a day of 24 bins: one static gear of 3 devices holds 3 in every hour
    assert reservation_curve([_span(0, 7200, "x", "y", "z")], 7200.0) == [3.0] * 24
    assert reservation_curve([], 3600.0, bins=3) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("duration_s, bins, field", [(0.0, 24, "duration_s"), (3600.0, 0, "bins")])
def test_reservation_curve_refuses_bad_input(duration_s, bins, field):
    with pytest.raises(InputError, match=field):
        reservation_curve([], duration_s, bins=bins)


def test_free_segments_are_the_fleet_minus_what_online_holds():
    fleet = frozenset({"a", "b", "c", "d"})
    spans = [_span(0, 100, "a", "b"), _span(100, 250, "a")]
    assert free_segments(spans, fleet, 300.0) == [(0.0, 100.0, frozenset({"c", "d"})),
                                                  (100.0, 250.0, frozenset({"b", "c", "d"})),
                                                  (250.0, 300.0, fleet)]
    assert merge_segments([(0.0, 10.0, fleet), (10.0, 20.0, fleet), (20.0, 20.0, fleet)]) == [(0.0, 20.0, fleet)]


# -- the offline backlog ------------------------------------------------------------------------
def test_backlog_takes_in_order_puts_back_at_front_and_cycles_with_new_ids():
    b = OfflineBacklog(_jobs(3).requests, cycle=True)
    first = b.take(2)
    assert [r.request_id for r in first] == ["job0", "job1"] and all(r.klass == "offline" for r in first)
    b.put_back(first[1:])
    assert [r.request_id for r in b.take(4)] == ["job1", "job2", "job0~1", "job1~1"]
    assert b.taken == 5
    once = OfflineBacklog(_jobs(3).requests)
    assert len(once.take(10)) == 3 and once.take(1) == []
    with pytest.raises(InputError, match="jobs"):
        OfflineBacklog([])


def test_sub_cluster_keeps_devices_and_links_among_them(lab):
    cluster, _, _ = lab
    ids = [d.device_id for d in cluster.devices][:2]
    sub = sub_cluster(cluster, ids)
    assert [d.device_id for d in sub.devices] == ids
    assert all(lk.src_device_id in ids and lk.dst_device_id in ids for lk in sub.links)
    with pytest.raises(InputError, match="unknown devices"):
        sub_cluster(cluster, ["nope"])


def test_offline_run_conserves_jobs_across_a_preemption(lab):
    cluster, spec, _ = lab
    jobs = _jobs(40)
    ids = [d.device_id for d in cluster.devices]
    planner = OfflinePlanner(cluster, spec, jobs)
    backlog = OfflineBacklog(jobs.requests)
    # a change of free devices after 0.05 s stops the first instance part-way; the second finishes the backlog
    run = run_offline([(0.0, 0.05, frozenset(ids[:3])), (0.05, 600.0, frozenset(ids[3:]))], planner, backlog,
                      warmup=False)
    assert len(run.completions) == 40
    assert run.tokens == sum(r.input_tokens + r.output_tokens for r in jobs.requests)
    assert run.output_tokens == sum(r.output_tokens for r in jobs.requests)
    assert run.lost == 0 and run.duplicated == 0 and run.pending == 0 and run.taken == 40
    assert [c.t_s for c in run.completions] == sorted(c.t_s for c in run.completions)


def test_offline_run_completes_at_most_the_backlog_and_charges_the_weight_load(lab):
    cluster, spec, _ = lab
    jobs = _jobs(10)
    ids = frozenset(d.device_id for d in cluster.devices)
    planner = OfflinePlanner(cluster, spec, jobs, load_gbps=1.0)
    inst = planner.instance(ids)
    assert inst.gear is not None and inst.load_s > 0
    # a stretch shorter than the weight load does no work: nothing completed, nothing lost
    short = run_offline([(0.0, inst.load_s / 2, ids)], planner, OfflineBacklog(jobs.requests))
    assert short.completions == [] and short.lost == 0 and short.warmup_s == pytest.approx(inst.load_s / 2)
    full = run_offline([(0.0, 3600.0, ids)], planner, OfflineBacklog(jobs.requests))
    assert len(full.completions) == 10 <= len(jobs)
    assert min(c.t_s for c in full.completions) >= inst.load_s
    assert full.lost == 0 and full.duplicated == 0


def test_no_free_devices_means_no_offline_work(lab):
    cluster, spec, _ = lab
    planner = OfflinePlanner(cluster, spec, _jobs(5))
    run = run_offline([(0.0, 100.0, frozenset())], planner, OfflineBacklog(_jobs(5).requests))
    assert run.completions == [] and run.taken == 0 and run.lost == 0


# -- the three policies -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def day(lab):
    cluster, spec, gears = lab
    workload = tide_day(start_day=0, duration_s=600.0, peak_rps=2.0)
    setting = DaySetting(workload=workload, duration_s=600.0, cluster=cluster, spec=spec, dtype="bf16",
                         gears=gears.gears, timings=gears.timings, sim_config=SimConfig(), window_s=100.0)
    return run_mixed_day(setting, Controller(replay_controller_config(2000.0)), _jobs(30), cycle_backlog=False)


def test_static_reservation_is_the_static_gears_devices_for_the_day(day, lab):
    _, _, gears = lab
    static_gear = next(g for g in gears.gears if g.gear_id == day.static_gear_id)
    static = day.policies["static"]
    hours = day.duration_s / 3600.0
    assert static.curve == [float(len(static_gear.device_ids))] * 24
    assert static.mean_devices * hours == pytest.approx(len(static_gear.device_ids) * hours)
    assert day.share_of_static("static") == 1.0 and static.shifts == 0


def test_oracle_bounds_dynamic_and_nothing_is_lost(day):
    dyn, oracle = day.policies["dynamic"], day.policies["oracle"]
    assert oracle.mean_devices <= dyn.mean_devices + 1e-9
    for p in day.policies.values():
        assert p.online_requests == day.policies["static"].online_requests > 0
        assert p.online_lost == 0
        assert len(p.offline.completions) <= 30
        assert p.offline.lost == 0 and p.offline.duplicated == 0
        assert len(p.curve) == 24
    figures = {g.name: g for g in goals(day)}
    assert figures["lost + duplicated"].met and figures["lost + duplicated"].value == 0.0
    assert figures["mean online reservation / static"].value == pytest.approx(day.share_of_static("dynamic"))
    doc = day.to_dict()
    assert set(doc["policies"]) == {"static", "dynamic", "oracle"}
    assert doc["policies"]["static"]["reservation_share_of_static"] == 1.0


def test_mixed_day_refuses_a_setting_without_gears(lab):
    cluster, spec, _ = lab
    setting = DaySetting(workload=_jobs(1), duration_s=600.0, cluster=cluster, spec=spec, dtype="bf16", gears=[],
                         timings={}, sim_config=SimConfig())
    with pytest.raises(InputError, match="gears"):
        run_mixed_day(setting, Controller(replay_controller_config(2000.0)), _jobs(3))


# -- CLI and asset ------------------------------------------------------------------------------
def _offline_csv(tmp_path):
    path = tmp_path / "jobs.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
                    + "".join(f"{100 + 10 * i},{10 + i},0,1\n" for i in range(20)))
    return path


def test_cli_simulate_day_json_shape(tmp_path, capsys):
    from flexpipe_dag.cli import main

    report = tmp_path / "day.html"
    rc = main(["simulate", "--day", "--cluster", str(EXAMPLES / "fragmented_lab.yaml"), "--model", MODEL,
               "--gears-from", "planner", "--duration-s", "600", "--peak-rps", "2", "--offline",
               str(_offline_csv(tmp_path)), "--offline-once", "--json", "--report", str(report)])
    assert rc == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "FLEXPIPE_CONTROL_FILE" not in captured.err  # said only when set (it is not read here)
    assert set(out["policies"]) == {"static", "dynamic", "oracle"}
    for p in out["policies"].values():
        assert len(p["reservation_curve_devices"]) == 24
        assert p["offline_jobs"] <= 20 and p["offline_lost"] == 0 and p["offline_duplicated"] == 0
        assert p["online_lost"] == 0
    assert out["policies"]["static"]["reservation_share_of_static"] == 1.0
    html = report.read_text()
    assert "reservation curve" in html and "data:image/png;base64," in html


@pytest.mark.parametrize("flags, field", [(["--duration-s", "0"], "--duration-s"), (["--trace", "azure-conv"], "--trace"),
                                          (["--start-day", "14"], "--start-day"),
                                          (["--slo-tpot-ms", "1e300"], "--slo-tpot-ms"),
                                          (["--report", "."], r"--report: is a directory"),
                                          (["--report", "/nonexistent-dir/x.html"], "directory /nonexistent-dir does not exist"),
                                          # single-gear flags are refused whatever their value, a falsy 0 too
                                          (["--micro-batch-size", "0"], "--micro-batch-size: is for a single-gear"),
                                          (["--max-inflight", "0"], "--max-inflight: is for a single-gear"),
                                          (["--kv-capacity-tokens", "0"], "--kv-capacity-tokens: is for a single-gear"),
                                          (["--chunked-prefill-tokens", "0"], "--chunked-prefill-tokens: is for a single"),
                                          (["--tide-compression", "0"], "--tide-compression: is for a single-gear"),
                                          (["--speedup", "4"], "--speedup: is for a single-gear"),
                                          (["--max-context-tokens", "512"], "--max-context-tokens: is for a single-gear"),
                                          (["--truncate-context"], "--truncate-context: is for a single-gear"),
                                          # the usage names them as alternatives: the second was silently ignored
                                          (["--peak-rps", "1", "--peak-share", "0.5"], "--peak-share: give --peak-rps R "
                                                                                       "or --peak-share S"),
                                          (["--peak-share", "1.6"], "--peak-share")])
def test_cli_simulate_day_refuses_bad_flags(flags, field):
    import argparse

    from flexpipe_dag.cli.simulate import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--day", "--cluster", "c.yaml", "--model", MODEL, *flags])
    with pytest.raises(InputError, match=field):
        args.func(args)


def test_mixed_day_asset_materialises_with_plots(tmp_path, monkeypatch):
    from dagster import materialize

    from flexpipe_dag.assets.mixed_day import mixed_day
    from flexpipe_dag.resources.planning import PlanningSettings
    from flexpipe_dag.resources.store_resource import StoreResource

    monkeypatch.setenv("FLEXPIPE_HOME", str(tmp_path / "home"))
    config = {"cluster_file": str(EXAMPLES / "fragmented_lab.yaml"), "duration_s": 600.0, "peak_rps": 2.0,
              "gears_from": "planner", "offline_trace": str(_offline_csv(tmp_path)), "cycle_backlog": False}
    result = materialize([mixed_day], resources={"store": StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}"),
                                                 "planning": PlanningSettings(model=MODEL)},
                         run_config={"ops": {"mixed_day": {"config": config}}})
    assert result.success
    meta = result.asset_materializations_for_node("mixed_day")[0].metadata
    for key in ("mixed_day_reservation_curve", "mixed_day_offline_tokens"):
        assert meta[key].value.startswith(f"![{key}](data:image/png;base64,")
    assert meta["lost"].value == 0
    assert (tmp_path / "home" / "reports" / "mixed_day_day0.html").is_file()
    assert "online SLO attainment" in meta["goals"].value


def test_cli_simulate_day_says_it_does_not_read_the_control_file(tmp_path, capsys, monkeypatch):
    """It was read by nothing here, silently, however broken."""
    from flexpipe_dag.cli import main

    monkeypatch.setenv("FLEXPIPE_CONTROL_FILE", str(tmp_path / "control.yaml"))
    assert main(["simulate", "--day", "--cluster", str(tmp_path / "missing.yaml"), "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert "control.yaml) is not read by simulate --day" in err and "missing.yaml" in err


def test_planner_gears_that_measure_worse_on_more_devices_are_left_out_with_a_note():
    from flexpipe_dag.control.day_setting import undominated
    from flexpipe_dag.sim import manual_gear

    def gear(gear_id: str, devices: int, rps_max: float):
        return manual_gear([4], replicas=[devices], gear_id=gear_id).model_copy(update={"rps_max": rps_max})

    small, mid, wide, dead = gear("latency-a", 2, 9.99), gear("balanced-b", 4, 6.29), gear("throughput-c", 7, 5.76), \
        gear("x-d", 1, 0.0)
    kept, notes = undominated([small, mid, wide, dead])
    assert [g.gear_id for g in kept] == ["latency-a"]
    assert notes == ["balanced-b left out: latency-a serves 9.99 req/s on 2 device(s), it 6.29 on 4",
                     "throughput-c left out: latency-a serves 9.99 req/s on 2 device(s), it 5.76 on 7",
                     "x-d left out: it meets the SLO at no rate"]
    bigger = gear("throughput-e", 7, 12.0)  # more devices for more capacity: a real step of the ladder
    assert [g.gear_id for g in undominated([small, bigger])[0]] == ["latency-a", "throughput-e"]
    twin = gear("latency-f", 2, 9.99)  # equal on both counts: neither beats the other
    assert len(undominated([small, twin])[0]) == 2
