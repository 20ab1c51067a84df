"""The planner's one path (plan_operating_gears): gears chosen by measured envelopes, each promise
holding on requests it was not measured on, the recommendation for a load, the short-probe warning."""

from __future__ import annotations

import math

import pytest

from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import EnvelopeBasis
from flexpipe_dag.planner.cost_model import CostModel
from flexpipe_dag.planner.envelope import check_promise, holdout_reference
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.planner.operating import recommend_gear, small_sample_note
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.sim import manual_gear
from tests.support import EXAMPLES


@pytest.fixture(scope="module")
def lab_plan():
    settings = PlanningSettings(model="Llama-3-8B", reference_requests=300)
    cluster = load_cluster_profile(EXAMPLES / "fragmented_lab.yaml")
    spec = load_model_spec("Llama-3-8B")
    return settings, cluster, spec, settings.plan(cluster, spec)


def test_every_gear_keeps_its_promise_at_80_percent_on_held_out_requests(lab_plan):
    settings, cluster, spec, plan = lab_plan
    holdout = holdout_reference(settings.reference_workload(), settings.reference_requests)
    assert plan.gears and all(g.rps_max > 0 for g in plan.gears)
    for g in plan.gears:
        chk = check_promise(g, CostModel(spec, cluster, dtype=g.dtype).timings(g), holdout,
                            slo_ttft_ms=settings.slo_ttft_ms, slo_tpot_ms=settings.slo_tpot_ms)
        assert chk.rate_rps == pytest.approx(0.8 * g.rps_max)
        assert chk.passed and chk.slo_attainment >= 0.9, (g.gear_id, chk.slo_attainment)


def test_gears_are_ordered_by_measured_envelope_and_name_their_basis(lab_plan):
    settings, _, _, plan = lab_plan
    assert [g.kind for g in plan.gears][-1] == "throughput"
    assert all(a.rps_max <= b.rps_max for a, b in zip(plan.gears, plan.gears[1:]))
    by_id = {e.gear_id.split("-", 1)[1]: e.rps_max for e in plan.envelopes}
    assert plan.gears[-1].rps_max == max(by_id.values())  # the largest measured envelope of all candidates
    for g in plan.gears:
        assert g.envelope_basis == plan.basis
        assert g.envelope_basis.slo_ttft_ms == settings.slo_ttft_ms and g.envelope_basis.source == "simulator"


def _gear(gid: str, devices: int, rps_max: float):
    return manual_gear([2], replicas=[devices], gear_id=gid).model_copy(update={"rps_max": rps_max})


def test_recommendation_is_the_fewest_devices_that_hold_the_load():
    small, big = _gear("small-1s-a", 1, 4.0), _gear("big-1s-b", 3, 10.0)
    rec = recommend_gear([small, big], 3.0)
    assert rec.gear_id == "small-1s-a" and rec.holds and rec.headroom_fraction == pytest.approx(0.25)
    rec = recommend_gear([small, big], 6.0)
    assert rec.gear_id == "big-1s-b" and rec.headroom_fraction == pytest.approx(0.4)
    # 3.8 req/s: the small gear holds it with 5 % headroom, the big one with 62 %: the big one is
    # recommended (the promise is checked at 80 % of rps_max); at 3.2 the small one keeps 20 %
    assert recommend_gear([small, big], 3.8).gear_id == "big-1s-b"
    assert recommend_gear([small, big], 3.2).gear_id == "small-1s-a"
    assert recommend_gear([small], 3.8).gear_id == "small-1s-a"  # the only one that holds it
    over = recommend_gear([small, big], 12.0)
    assert over.gear_id == "big-1s-b" and not over.holds and "no gear holds" in over.reason
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(InputError, match="load_rps"):
            recommend_gear([small], bad)


def test_envelopes_measured_on_a_small_sample_are_flagged():
    basis = EnvelopeBasis(source="simulator", slo_ttft_ms=2000.0, slo_tpot_ms=200.0, attainment=0.95,
                          workload="azure-conv", num_requests=400)
    note = small_sample_note(basis, 19_366)
    assert note and "samples of 400 requests of azure-conv" in note and "at least 1000 requests" in note
    assert small_sample_note(basis.model_copy(update={"num_requests": 1000}), 19_366) is None
    assert small_sample_note(basis, 400) is None  # the whole of a short trace: its own sample
