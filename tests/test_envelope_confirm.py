"""A gear's envelope is confirmed on long probes of two samples, so it holds on minutes of held-out traffic.

The case a new user found (2026-12-07): on the bundled lab fleet the planner promised its throughput gear
11.33 req/s on 1,000-request probes (88 s of arrivals); a 300-s replay of another sample of the same trace
at that rate met the SLO for 60 % of requests. Near its top the gear needs minutes to fill its seats with
long requests, and the short probe ended first.
"""

from __future__ import annotations

from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.planner.cost_model import CostModel
from flexpipe_dag.planner.envelope import CONFIRM_PHASES, CONFIRM_PROBE_S, measure_envelope, probe_gear, probe_reference
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.workload.bundled import load_trace
from flexpipe_dag.workload.context import apply_context_rule
from tests.support import REPO

SLO_TTFT_MS, SLO_TPOT_MS = 2000.0, 200.0

#: `flexpipe plan --cluster examples/clusters/fragmented_lab.yaml --model Llama-3-8B`'s throughput gear, as planned.
LAB_THROUGHPUT_GEAR = {
    "gear_id": "throughput-2s-0996087f", "kind": "throughput", "model_name": "Llama-3-8B", "dtype": "fp16",
    "num_layers": 32, "micro_batch_size": 32, "max_inflight_micro_batches": 4, "kv_block_size_tokens": 16,
    "kv_capacity_tokens": 438582, "cluster_id": "fragmented-lab",
    "stages": [
        {"stage_index": 0, "layer_start": 0, "layer_end": 10, "device_ids": ["host-v100-gpu0", "host-v100-gpu1"],
         "est_stage_ms": 10.022097, "weight_gib": 5.0412, "kv_capacity_tokens": 438582},
        {"stage_index": 1, "layer_start": 10, "layer_end": 32, "device_ids": ["host-a100-gpu0", "host-a100-gpu1"],
         "est_stage_ms": 11.097275, "weight_gib": 9.9164, "kv_capacity_tokens": 1429938},
    ],
}


def test_the_lab_throughput_gear_envelope_holds_on_minutes_of_held_out_traffic():
    cluster = load_cluster_profile(REPO / "examples/clusters/fragmented_lab.yaml")
    model = load_model_spec("Llama-3-8B")
    gear = Gear.model_validate(LAB_THROUGHPUT_GEAR)
    timing = CostModel(model, cluster, dtype=gear.dtype).timings(gear)
    reference = apply_context_rule(load_trace("azure-conv"), model.max_context_tokens, "refuse").workload
    env = measure_envelope(gear, timing, reference, slo_ttft_ms=SLO_TTFT_MS, slo_tpot_ms=SLO_TPOT_MS, rel_tol=0.05,
                           start_rps=11.33)
    assert 9.0 <= env.rps_max < 11.33  # the short probes alone said 11.33-11.51
    # the promise's own probes: two samples at the envelope, each at least CONFIRM_PROBE_S of arrivals
    at_top = [p for p in env.probes if p.rate_rps == env.rps_max]
    assert len(at_top) >= len(CONFIRM_PHASES) and all(p.passed for p in at_top)
    config = SimConfig(slo_ttft_ms=SLO_TTFT_MS, slo_tpot_ms=SLO_TPOT_MS, metric_samples=False)
    for phase in (0.5, 0.75):  # samples the envelope was never measured on
        ref, native = probe_reference(reference, 1000, env.rps_max, SLO_TTFT_MS, min_duration_s=CONFIRM_PROBE_S,
                                      phase=phase)
        assert ref.duration_s * env.rps_max / native >= 0.99 * CONFIRM_PROBE_S
        held_out = probe_gear(gear, timing, ref, native, env.rps_max, config=config, early_stop=False)
        assert held_out.slo_attainment >= 0.95 and held_out.lost == 0, (phase, held_out)


def test_a_top_that_does_not_hold_on_long_probes_steps_down_then_halves(monkeypatch):
    """The confirming probes step down by 10 % while within half the short probes' top, then halve."""
    import flexpipe_dag.planner.envelope as envelope
    from flexpipe_dag.planner.envelope import EnvelopeProbe
    from flexpipe_dag.sim import manual_gear
    from flexpipe_dag.workload.request import Request, Workload

    rates: list[tuple[float, bool]] = []  # (rate, long probe?)
    asked = {"long": False}
    real_reference = envelope.probe_reference

    def reference(*args, **kwargs):
        asked["long"] = kwargs.get("min_duration_s", 0.0) >= CONFIRM_PROBE_S
        return real_reference(*args, **kwargs)

    def probe(gear, timing, ref, native, rate, **kwargs):
        long = asked["long"]
        rates.append((rate, long))
        ok = rate <= (1.0 if long else 10.0)  # short probes pass up to 10 req/s, long ones only up to 1
        return EnvelopeProbe(rate_rps=rate, slo_attainment=1.0 if ok else 0.0, lost=0, ttft_p99_ms=1.0,
                             tpot_p99_ms=1.0, passed=ok, estimate=None)

    monkeypatch.setattr(envelope, "probe_gear", probe)
    monkeypatch.setattr(envelope, "probe_reference", reference)
    monkeypatch.setattr(envelope, "zero_load_misses", lambda *a, **k: 0)
    trace = Workload(name="uniform", requests=tuple(Request(f"r{i}", i * 0.01, 1, 1) for i in range(5000)))
    env = measure_envelope(manual_gear([4], gear_id="g"), None, trace, start_rps=8.0, rel_tol=0.05)
    long_rates = [r for r, long in rates if long]
    assert long_rates[0] == 10.0  # the short probes' top (they pass up to 10 req/s)
    ratios = [round(b / a, 6) for a, b in zip(long_rates, long_rates[1:])]
    assert ratios[:10] == [0.9] * 7 + [0.5] * 3  # 10 % steps down to half the top, then halvings, until one holds
    assert 0.95 <= env.rps_max <= 1.0  # bisected back up to the long limit
