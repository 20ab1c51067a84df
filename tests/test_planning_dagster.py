"""Planning assets in Dagster: model_profile, candidate_gears (+ fit check) and gear_evaluations."""

from __future__ import annotations

from dagster import materialize

from flexpipe_dag.assets.evaluation import gear_evaluations
from flexpipe_dag.assets.planning import candidate_gears, candidate_gears_fit, model_profile
from flexpipe_dag.assets.profiling import gpu_profile
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.planner.verify import gear_problems
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.prober import ProberResource
from flexpipe_dag.resources.store_resource import StoreResource
from tests.support import EXAMPLES

ASSETS = [gpu_profile, model_profile, candidate_gears, candidate_gears_fit, gear_evaluations]


def _resources(tmp_path, model="Llama-3-8B", cluster="fragmented_lab.yaml"):
    return {"store": StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}"),
            "prober": ProberResource(probe=False, cluster_file=str(EXAMPLES / cluster)),
            "planning": PlanningSettings(model=model, reference_requests=300)}


def test_plan_and_evaluate_chain_stores_gears(tmp_path):
    res = _resources(tmp_path)
    result = materialize(ASSETS, resources=res)
    assert result.success
    (check,) = result.get_asset_check_evaluations()
    assert check.passed and check.metadata["gears_checked"].value >= 1
    db = res["store"].get_store()
    (info,) = db.list_profile_versions()
    gears = db.load_gears(info.id)
    assert {g.kind for g in gears} <= {"latency", "balanced", "throughput"} and gears
    assert all(g.profile_version == info.id for g in gears)
    meta = result.asset_materializations_for_node("gear_evaluations")[0].metadata
    assert meta["requests"].value == res["planning"].reference_requests
    for g in gears:
        assert g.gear_id in meta["evaluations"].value


def test_model_change_clears_health_tags(tmp_path):
    res = _resources(tmp_path, model="SmolLM2-135M")
    assert materialize([model_profile], resources=res).success
    db = res["store"].get_store()
    db.mark_unhealthy("g", "fragmented-lab", "SmolLM2-135M", "oom", "stage 0 OOM")
    assert materialize([model_profile], resources=res).success  # same model: tag stays
    assert db.unhealthy_gear_keys() == {"g"}
    res["planning"] = PlanningSettings(model="SmolLM2-135M", dtype="fp32")  # a changed model profile
    assert materialize([model_profile], resources=res).success
    assert db.unhealthy_gear_keys() == set()


def test_fit_check_catches_a_gear_that_does_not_fit():
    cluster = load_cluster_profile(EXAMPLES / "fragmented_lab.yaml")
    spec = load_model_spec("Llama-3-8B")
    from flexpipe_dag.planner.gears import plan_gears

    gear = plan_gears(cluster, spec, concurrency=16, context_p95_tokens=2048)[0]
    assert gear_problems(gear, cluster, spec) == []
    st = gear.stages[0]
    too_big = gear.model_copy(update={"stages": [st.model_copy(update={"weight_gib": 500.0})] + gear.stages[1:]})
    assert any("exceed" in p for p in gear_problems(too_big, cluster, spec))
    moved = gear.model_copy(update={"stages": [st.model_copy(update={"device_ids": ["nope"]})] + gear.stages[1:]})
    assert any("unknown device" in p for p in gear_problems(moved, cluster, spec))


def test_cli_and_dagster_plan_the_same_gears_for_the_same_fleet(tmp_path, capsys):
    """One code path, one set of defaults: `flexpipe plan` prints the gears the asset stores."""
    import json

    from flexpipe_dag.cli import main

    res = {**_resources(tmp_path, model="Llama-3-8B", cluster="alibaba_openb.yaml"),
           "planning": PlanningSettings(model="Llama-3-8B", reference_requests=60)}
    assert materialize([gpu_profile, model_profile, candidate_gears], resources=res).success
    stored = res["store"].get_store().load_gears()
    assert main(["plan", "--cluster", str(EXAMPLES / "alibaba_openb.yaml"), "--model", "Llama-3-8B",
                 "--requests", "60", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["gears"]
    assert [g.gear_id for g in stored] == [g["gear_id"] for g in printed]
    assert [g.rps_max for g in stored] == [g["rps_max"] for g in printed]
    assert all(g.envelope_basis is not None and g.envelope_basis.num_requests == 60 for g in stored)
