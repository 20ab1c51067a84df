"""Calibration fitting (pure): step work matches the cost model, known scales are recovered robustly,
devices without evidence keep their profile, links, re-scoring, and the plain-data round trip."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from flexpipe_dag.calibration import FitSettings, StageObservation, calibrate, fit_time_scales, rescore_gears
from flexpipe_dag.calibration.calibrate import Calibration, predicted_step_ms
from flexpipe_dag.calibration.links import fit_link
from flexpipe_dag.calibration.observation import link_summaries, stage_time_summaries
from flexpipe_dag.calibration.plots import plot_predicted_vs_measured, stage_time_errors
from flexpipe_dag.calibration.work import predict_terms_ms, roofline_terms, step_work_by_class
from flexpipe_dag.core.cluster import ClusterProfile, Device, Link
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear, StagePlan
from flexpipe_dag.planner.cost_model import CostModel, default_efficiency
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.planner.workload import PlanWorkload

SPEC = load_model_spec("SmolLM2-135M")


def cpu_cluster(peak0: float = 0.024, peak1: float = 0.024, devices: int = 2) -> ClusterProfile:
    peaks = [peak0, peak1, 0.024][:devices]
    devs = [Device(device_id=f"cpu{i}", node_id="host", model_name="cpu-worker", kind="cpu-worker", memory_gib=4.0,
                   peak_tflops=p, hbm_bandwidth_gbps=9.0, compute_score=p / 312.0) for i, p in enumerate(peaks)]
    links = [Link(src_device_id=a.device_id, dst_device_id=b.device_id, bandwidth_gbps=1.0, latency_us=100.0, kind="gloo")
             for a in devs for b in devs if a is not b]
    return ClusterProfile(cluster_id="cpu-host", devices=devs, links=links, source="probe",
                          measured_at=dt.datetime(2026, 11, 29, tzinfo=dt.UTC))


def obs(device: str, stage: int, kind: str, seqs: int, tokens_per_seq: int, ctx_per_seq: int, layers=(0, 15),
        first=True, last=False, ms=1.0, send_ms=None, send_bytes=0) -> StageObservation:
    if kind == "prefill":
        pre, dec, prompt, kv = seqs, 0, seqs * tokens_per_seq, seqs * tokens_per_seq
        pairs = seqs * tokens_per_seq * (tokens_per_seq + 1) // 2
    else:
        pre, dec, prompt, kv = 0, seqs, 0, seqs * ctx_per_seq
        pairs = kv
    return StageObservation(gear_id="g", stage_index=stage, device_id=device, is_first=first, is_last=last,
                            layer_start=layers[0], layer_end=layers[1], kind=kind, num_seqs=seqs, prefill_seqs=pre,
                            prompt_tokens=prompt, decode_tokens=dec, kv_context_tokens=kv, attended_pairs=pairs,
                            wall_ms=ms, send_ms=send_ms, send_bytes=send_bytes,
                            dst_device_id=None if last else "cpu1")


def synthetic_run(cluster: ClusterProfile, true_scales: dict[str, dict[str, float]], n: int = 60, noise: float = 0.08,
                  seed: int = 0, outliers: int = 0) -> list[StageObservation]:
    """Steps on cpu0 (first stage) and cpu1 (last stage) timed by the roofline with known time scales."""
    rng = np.random.default_rng(seed)
    out = []
    eff = default_efficiency()
    for dev, stage, first, last in (("cpu0", 0, True, False), ("cpu1", 1, False, True)):
        if dev not in true_scales:
            continue
        k = true_scales[dev]
        d = cluster.device(dev)
        for i in range(n):
            if i % 4 == 0:
                o = obs(dev, stage, "prefill", int(rng.integers(1, 5)), int(rng.integers(20, 120)), 0,
                        layers=(0, 15) if stage == 0 else (15, 30), first=first, last=last)
            else:
                b = int(rng.integers(1, 9))
                o = obs(dev, stage, "decode", b, 1, int(rng.integers(30, 200)),
                        layers=(0, 15) if stage == 0 else (15, 30), first=first, last=last)
            tc, tm, to = roofline_terms([step_work_by_class(SPEC, o, "fp32")], d.peak_tflops, d.hbm_bandwidth_gbps, eff)
            t = predict_terms_ms(tc, tm, to, 1 / k["compute"], 1 / k["memory"], 1 / k["overhead"])[0]
            t *= float(np.exp(rng.normal(0, noise)))
            if i < outliers:
                t *= 8.0  # a step stalled by something else on the host
            sent = None if last else float(0.1 + 64 * o.num_tokens * 576 * 4 / 1e9 * 1e3 * 2 + rng.exponential(0.5))
            out.append(StageObservation(**{**o.to_dict(), "wall_ms": t, "send_ms": sent, "mb_id": i,
                                           "send_bytes": 0 if last else o.num_tokens * 576 * 4}))
    return out


def test_step_work_matches_cost_model_for_decode_and_single_prefill():
    cluster = cpu_cluster()
    cm = CostModel(SPEC, cluster, dtype="fp32")
    d = cluster.device("cpu0")
    # a mixed step (3 prompts of 40 tokens, or chunks, beside 5 decodes of 100 cached tokens each) in one
    # pass: what the runtime records and the simulator prices through stage_step_ms
    mixed = StageObservation(gear_id="g", stage_index=0, device_id="cpu0", is_first=True, is_last=True,
                             layer_start=0, layer_end=12, kind="mixed", num_seqs=8, prefill_seqs=3, prompt_tokens=120,
                             decode_tokens=5, kv_context_tokens=620, attended_pairs=3 * 40 * 41 // 2 + 500, wall_ms=1.0,
                             send_ms=None, send_bytes=0, dst_device_id=None)
    assert cm.stage_step_ms("cpu0", 12, True, True, 120, 3, 5, 500) < (
        cm.stage_prefill_ms("cpu0", 12, True, True, 120, 3) + cm.stage_decode_ms("cpu0", 12, True, True, 5, 500))
    for o, want in [
        (mixed, cm.stage_step_ms("cpu0", 12, True, True, 120, 3, 5, 500)),
        (obs("cpu0", 0, "decode", 4, 1, 100, layers=(0, 12), first=True, last=False),
         cm.stage_decode_ms("cpu0", 12, True, False, 4, 400)),
        (obs("cpu0", 0, "prefill", 1, 77, 0, layers=(3, 30), first=False, last=True),
         cm.stage_prefill_ms("cpu0", 27, False, True, 77, 1)),
    ]:
        tc, tm, to = roofline_terms([step_work_by_class(SPEC, o, "fp32")], d.peak_tflops, d.hbm_bandwidth_gbps,
                                    default_efficiency())
        assert predict_terms_ms(tc, tm, to)[0] == pytest.approx(want, rel=1e-9)
        assert predicted_step_ms(cm, [o])[0] == pytest.approx(want, rel=1e-9)


def test_fit_recovers_known_scales_despite_outliers():
    cluster = cpu_cluster()
    truth = {"cpu0": {"compute": 2.0, "memory": 1.0, "overhead": 50.0},
             "cpu1": {"compute": 1.0, "memory": 1.0, "overhead": 50.0}}
    observations = synthetic_run(cluster, truth, n=80, outliers=6)
    cal = calibrate(SPEC, cluster, observations, dtype="fp32")
    for dev in ("cpu0", "cpu1"):
        fit = cal.devices[dev].fit
        assert fit.fitted and fit.identified["compute"] and fit.identified["overhead"]
        assert fit.scales["compute"] == pytest.approx(truth[dev]["compute"], rel=0.1)
        assert fit.scales["overhead"] == pytest.approx(truth[dev]["overhead"], rel=0.15)
        assert fit.num_rejected >= 6  # the stalled steps are rejected, not fitted
        assert fit.median_ape_after < 0.1 < fit.median_ape_before
        assert 0 < fit.confidence["compute"] <= 1
    # the calibrated cost model predicts the clean steps within a few percent
    cm = cal.cost_model(SPEC, cluster)
    clean = [o for i, o in enumerate(observations) if i % 80 >= 6]
    ratio = predicted_step_ms(cm, clean) / np.array([o.wall_ms for o in clean])
    assert np.median(np.abs(ratio - 1)) < 0.1


def test_device_without_evidence_keeps_its_profile_and_raw_profile_untouched():
    cluster = cpu_cluster(devices=3)
    before = cluster.model_dump()
    observations = synthetic_run(cluster, {"cpu0": {"compute": 2.0, "memory": 1.0, "overhead": 20.0}}, n=40)
    few = synthetic_run(cluster, {"cpu1": {"compute": 3.0, "memory": 1.0, "overhead": 20.0}}, n=5)
    cal = calibrate(SPEC, cluster, observations + few, dtype="fp32")
    assert cal.devices["cpu0"].changed
    assert not cal.devices["cpu1"].changed and "profile kept" in cal.devices["cpu1"].summary()  # 5 < min steps
    assert not cal.devices["cpu2"].changed  # no steps at all
    assert set(cal.device_overrides()) == {"cpu0"}
    cm0, cm1 = CostModel(SPEC, cluster, dtype="fp32"), cal.cost_model(SPEC, cluster)
    for dev in ("cpu1", "cpu2"):
        assert cm1.stage_decode_ms(dev, 10, False, False, 4, 400) == cm0.stage_decode_ms(dev, 10, False, False, 4, 400)
    assert cm1.stage_prefill_ms("cpu0", 10, True, False, 200) > 1.5 * cm0.stage_prefill_ms("cpu0", 10, True, False, 200)
    calibrated = cal.calibrated_cluster(cluster)
    assert cluster.model_dump() == before  # the raw profile object is never modified
    assert [d.model_dump() for d in calibrated.devices] == [d.model_dump() for d in cluster.devices]


def test_prior_chaining_and_round_trip():
    cluster = cpu_cluster()
    truth = {"cpu0": {"compute": 2.0, "memory": 1.0, "overhead": 30.0}}
    first = calibrate(SPEC, cluster, synthetic_run(cluster, truth, n=40, seed=1), dtype="fp32")
    again = calibrate(SPEC, cluster, synthetic_run(cluster, truth, n=40, seed=2), dtype="fp32", prior=first)
    # relative to the already calibrated prior, the new evidence asks for (almost) no change
    assert again.devices["cpu0"].fit.scales["compute"] == pytest.approx(1.0, abs=0.1)
    assert again.devices["cpu0"].overrides["gemm"].compute == pytest.approx(
        first.devices["cpu0"].overrides["gemm"].compute, rel=0.1)
    back = Calibration.from_dict(again.to_dict())
    assert back.device_overrides() == again.device_overrides()
    assert back.summary_lines() == again.summary_lines()


def test_too_little_evidence_and_settings_errors():
    fit = fit_time_scales(np.ones((3, 5)), np.ones((3, 5)), np.ones((3, 5)), np.ones(3))
    assert not fit.fitted and fit.scales == {"compute": 1.0, "memory": 1.0, "overhead": 1.0}
    with pytest.raises(ValueError):
        fit_time_scales(np.ones((3, 5)), np.ones((3, 5)), np.ones((3, 5)), np.array([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError):
        FitSettings(prior_sd=(0.5, 0.0, 1.0))


def test_bandwidth_bound_steps_leave_compute_unidentified():
    cluster = cpu_cluster()
    # decode of 1-2 sequences reads the weights once for few FLOPs: no step is compute-bound
    observations = [o for o in synthetic_run(cluster, {"cpu0": {"compute": 1.0, "memory": 1.0, "overhead": 40.0}}, n=200)
                    if o.kind == "decode" and o.num_seqs <= 2]
    fit = calibrate(SPEC, cluster, observations, dtype="fp32").devices["cpu0"].fit
    assert fit.fitted and fit.identified["overhead"]
    assert not fit.identified["compute"] and fit.scales["compute"] == 1.0


def test_link_fit_lower_envelope_and_fallbacks():
    rng = np.random.default_rng(0)
    sizes = np.repeat([10_000, 100_000, 1_000_000], 30).astype(float)
    true = 0.2 + sizes / 2e9 * 1e3  # 200 us + 2 GB/s
    waits = rng.exponential(5.0, len(sizes)) * (rng.random(len(sizes)) > 0.3)  # receiver busy 70 % of the time
    fit = fit_link("a", "b", sizes, true + waits, 1.0, 100.0)
    assert fit.fitted and fit.num_bins == 3
    assert fit.bandwidth_gbps == pytest.approx(2.0, rel=0.3) and fit.latency_us == pytest.approx(200, rel=0.5)
    few = fit_link("a", "b", sizes[:5], true[:5], 1.0, 100.0)
    assert not few.fitted and few.bandwidth_gbps == 1.0 and "profile kept" in few.notes[0]


def test_summaries_count_and_group():
    cluster = cpu_cluster()
    observations = synthetic_run(cluster, {"cpu0": {"compute": 1, "memory": 1, "overhead": 10},
                                           "cpu1": {"compute": 1, "memory": 1, "overhead": 10}}, n=20)
    sums = stage_time_summaries(observations)
    assert {(s.device_id, s.kind) for s in sums} == {(d, k) for d in ("cpu0", "cpu1") for k in ("prefill", "decode")}
    assert sum(s.count for s in sums) == len(observations)
    (link,) = link_summaries(observations)
    assert (link.src_device_id, link.dst_device_id, link.count) == ("cpu0", "cpu1", 20)
    with pytest.raises(InputError, match="kind"):
        StageObservation(**{**observations[0].to_dict(), "kind": "other"})


def test_rescore_flags_moved_estimates_and_changed_choice_and_plots():
    wrong = cpu_cluster(peak0=0.048)  # cpu0's compute claimed twice too high
    truth = {"cpu0": {"compute": 2.0, "memory": 1.0, "overhead": 40.0},  # relative to the wrong profile
             "cpu1": {"compute": 1.0, "memory": 1.0, "overhead": 40.0}}
    observations = synthetic_run(wrong, truth, n=80)
    cal = calibrate(SPEC, wrong, observations, dtype="fp32")
    w = PlanWorkload(context_p95_tokens=160, concurrency=8, prompt_tokens_mean=96, output_tokens_mean=16,
                     prefill_chunk_tokens=128, micro_batch_size_candidates=(1, 2, 4, 8))
    gear = Gear(gear_id="g", kind="manual", model_name=SPEC.name, dtype="fp32", num_layers=30, micro_batch_size=4,
                stages=[StagePlan(stage_index=0, layer_start=0, layer_end=20, device_ids=["cpu0"]),
                        StagePlan(stage_index=1, layer_start=20, layer_end=30, device_ids=["cpu1"])], rps_max=2.0)
    res = rescore_gears(SPEC, wrong, cal, [gear], workload=w, margin=0.1)
    (g,) = res.gears
    assert g.exceeds_margin and res.needs_replan
    assert g.after["throughput_rps"] < g.before["throughput_rps"]
    assert g.updated.rps_max < gear.rps_max and "now sustains" in g.message
    assert res.choice_changed
    def imbalance(gears):
        thr = next(x for x in gears if x.kind == "throughput")
        return (max(s.num_layers for s in thr.stages) - min(s.num_layers for s in thr.stages)
                if thr.num_stages > 1 else 0)
    assert imbalance(res.planned_after) < imbalance(res.planned_before)
    assert any("pick changes" in m for m in res.messages())
    # a calibration that changes nothing moves nothing
    none = calibrate(SPEC, wrong, [], dtype="fp32")
    quiet = rescore_gears(SPEC, wrong, none, [gear], workload=w, margin=0.1)
    assert not quiet.needs_replan and quiet.gears[0].max_change == 0.0
    before, after = CostModel(SPEC, wrong, dtype="fp32"), cal.cost_model(SPEC, wrong)
    errs = stage_time_errors(before, after, observations)
    assert errs["cpu0"]["median_ape_after"] < errs["cpu0"]["median_ape_before"]
    png = plot_predicted_vs_measured(before, after, observations)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
