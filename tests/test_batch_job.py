"""The batch_inference Dagster job on the real runtime: results in the store, resumable, measured steps
recorded, and the calibration asset fits them (CPU, SmolLM2)."""

from __future__ import annotations

import time

import pytest
from dagster import DagsterInstance, RunRequest, build_sensor_context, materialize

from flexpipe_dag.assets.calibration import calibration
from flexpipe_dag.assets.planning import candidate_gears, model_profile
from flexpipe_dag.assets.profiling import gpu_profile
from flexpipe_dag.jobs.batch import batch_inference
from flexpipe_dag.jobs.replan import replan_sensor
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.prober import ProberResource
from flexpipe_dag.resources.store_resource import StoreResource

pytestmark = pytest.mark.slow

CPU_HOST = {"cluster_id": "cpu-host", "devices": [
    {"device_id": f"cpu{i}", "node_id": "host", "kind": "cpu-worker", "model_name": "cpu-worker", "memory_gib": 8.0,
     "peak_tflops": 0.05, "hbm_bandwidth_gbps": 20.0, "compute_score": 0.05 / 312} for i in range(2)],
    "links": [{"src_device_id": "cpu0", "dst_device_id": "cpu1", "bandwidth_gbps": 3.0, "latency_us": 100.0},
              {"src_device_id": "cpu1", "dst_device_id": "cpu0", "bandwidth_gbps": 3.0, "latency_us": 100.0}]}


def test_batch_job_stores_results_resumes_and_feeds_calibration(tmp_path):
    import json

    cluster_file = tmp_path / "cpu_host.json"
    cluster_file.write_text(json.dumps(CPU_HOST))
    res = {"store": StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}"),
           "prober": ProberResource(probe=False, cluster_file=str(cluster_file)),
           "planning": PlanningSettings(dtype="fp32", max_prompt_tokens=48, max_new_tokens=6, concurrency=8,
                                        stage_replicas=False)}
    assert materialize([gpu_profile, model_profile, candidate_gears], resources=res).success
    db = res["store"].get_store()
    gear = max((g for g in db.load_gears() if all(s.replicas == 1 for s in g.stages)),
               key=lambda g: (g.num_stages, g.gear_id))  # the deepest: every stage's steps are measured
    run_config = {"ops": {"run_batch": {"config": {
        "job_key": "job-1", "trace": "azure-conv", "num_requests": 6, "max_prompt_tokens": 48, "max_new_tokens": 6,
        "gear_id": gear.gear_id, "step_timeout_s": 120.0}}}}
    first = batch_inference.execute_in_process(run_config=run_config, resources={"store": res["store"]})
    assert first.success
    (job,) = db.jobs()
    assert job.status == "done" and job.total_requests == 6
    results = db.results(job.id)
    assert len(results) == 6 and all(r.output_tokens >= 1 and r.gear_key == gear.gear_id for r in results)
    assert db.observed_runs() and db.observed_runs()[0]["steps"] > 0
    samples = db.read_samples(run_key=first.run_id)
    assert samples and all(s.source == "live" and s.gear_id == gear.gear_id for _, s in samples)
    # a re-run of the same job finishes nothing new and writes no duplicate
    again = batch_inference.execute_in_process(run_config=run_config, resources={"store": res["store"]})
    assert again.success and len(db.results(job.id)) == 6
    # the measured steps become a calibration version; the profile's raw rows are untouched
    before = db.latest_profile()[1]
    instance = DagsterInstance.ephemeral()
    cal = materialize([calibration], resources=res, instance=instance)
    assert cal.success
    m = cal.asset_materializations_for_node("calibration")[0].metadata
    assert m["calibration_version"].value == 1 and m["new_steps"].value > 10
    # the replan sensor re-plans exactly when the calibration moved a gear past the margin, once
    tick = replan_sensor.evaluate_tick(build_sensor_context(instance=instance))
    if m["needs_replan"].value:
        (req,) = tick.run_requests
        assert isinstance(req, RunRequest) and req.run_key == f"replan:calibration-{m['calibration_id'].value}"
    else:
        assert not tick.run_requests and "past the margin" in tick.skip_message
    assert db.latest_profile()[1] == before
    # nothing new: a second materialisation keeps the profile's values and saves nothing
    m2 = materialize([calibration], resources=res).asset_materializations_for_node("calibration")[0].metadata
    assert m2["new_steps"].value == 0 and len(db.calibrations()) == 1


def test_malformed_prompt_rows_are_counted_not_fatal(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "The capital of France is", "max_new_tokens": 4}\n'
                       'not json\n{"prompt": "no id"}\n{"id": "b", "prompt": "Once upon a time", "max_new_tokens": 4}\n')
    store = StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}")
    result = batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": {
        "job_key": "prompts-1", "prompts_path": str(prompts), "stages": 1}}}}, resources={"store": store})
    assert result.success
    (job,) = store.get_store().jobs()
    assert job.malformed_rows == 2 and job.status == "done"
    assert {r.request_key for r in store.get_store().results(job.id)} == {"a", "b"}


def test_a_batch_run_waits_for_the_runtime_already_on_this_host(tmp_path):
    """run_batch takes the host's runtime lock (Dagster's pool alone can let two runs through): while a
    serve run holds it, the batch run waits, says whom for, and registers nothing; then it runs."""
    import threading

    from dagster import DagsterInstance

    from tests.test_runtime_host_lock import _start_holder

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "The capital of France is", "max_new_tokens": 3}\n')
    store = StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}")
    holder = _start_holder()
    seen_while_waiting: list = []

    instance = DagsterInstance.ephemeral()

    def release_once_waiting() -> None:
        deadline = time.monotonic() + 240.0
        while time.monotonic() < deadline and not any(
                "waiting for the pipeline runtime" in e.user_message
                for r in instance.get_runs() for e in instance.all_logs(r.run_id)):
            time.sleep(0.2)
        seen_while_waiting.extend(store.get_store().jobs())  # the waiting run has not registered its job
        holder.stdin.close()

    threading.Thread(target=release_once_waiting, daemon=True).start()
    try:
        result = batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": {
            "job_key": "after-serve", "prompts_path": str(prompts), "stages": 1}}}},
            resources={"store": store}, instance=instance)
    finally:
        holder.kill()
    assert result.success and seen_while_waiting == []
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert any("waiting for the pipeline runtime on this host" in m and "held by Dagster run feedbeef (serve)" in m
               for m in logs), logs
    assert any(m.startswith("pipeline runtime lock taken after waiting") for m in logs)
    (job,) = store.get_store().jobs()
    assert job.status == "done"
