"""The gpu_profile asset, its check, the refresh schedule, and the real host probe."""

from __future__ import annotations

import json

import pytest
from dagster import DagsterInstance, build_schedule_context, materialize

from flexpipe_dag.assets.profiling import gpu_profile, gpu_profile_sane
from flexpipe_dag.cli import main as cli_main
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.definitions import defs
from flexpipe_dag.jobs.profiling import DEFAULT_PROFILE_REFRESH_CRON, profile_refresh_schedule
from flexpipe_dag.profiling.summary import profile_problems
from flexpipe_dag.resources.prober import ProberResource
from flexpipe_dag.resources.store_resource import StoreResource
from tests.support import EXAMPLES


def _resources(tmp_path, **prober):
    return {"store": StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}"),
            "prober": ProberResource(**prober)}


def test_materialise_writes_new_profile_version_and_check_passes(tmp_path):
    res = _resources(tmp_path, probe=False, cluster_file=str(EXAMPLES / "fragmented_lab.yaml"))
    for expected_version in (1, 2):
        result = materialize([gpu_profile, gpu_profile_sane], resources=res)
        assert result.success
        meta = result.asset_materializations_for_node("gpu_profile")[0].metadata
        assert meta["version"].value == expected_version
        assert meta["num_devices"].value == 7
        assert "data:image/png;base64," in meta["link_bandwidth_fragmented-lab"].value
        (check,) = result.get_asset_check_evaluations()
        assert check.passed
    store = res["store"].get_store()
    assert [v.version for v in store.list_profile_versions("fragmented-lab")] == [1, 2]


def test_profile_refresh_clears_health_tags(tmp_path):
    res = _resources(tmp_path, probe=False, cluster_file=str(EXAMPLES / "fragmented_lab.yaml"))
    res["store"].get_store().mark_unhealthy("g", "fragmented-lab", "m", "oom", "stage 2 OOM")
    assert materialize([gpu_profile], resources=res).success
    assert res["store"].get_store().unhealthy_gear_keys() == set()


def test_check_finds_problems():
    profile = load_cluster_profile(EXAMPLES / "seed_example.yaml")
    assert profile_problems(profile) == []
    broken = profile.model_copy(deep=True)
    object.__setattr__(broken.links[0], "bandwidth_gbps", 0.0)  # as a hand-edited database row could be
    assert profile_problems(broken) == ["link gpu_001->gpu_002: bandwidth_gbps 0.0 <= 0"]


def test_bad_declared_file_fails_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - {node_id: a, memory_gb: 0, compute_score: 1}\n")
    res = _resources(tmp_path, probe=False, cluster_file=str(bad))
    result = materialize([gpu_profile], resources=res, raise_on_error=False)
    assert not result.success
    assert res["store"].get_store().list_profile_versions() == []


def test_schedule_defaults_nightly_and_is_configurable(monkeypatch):
    sched = defs.resolve_schedule_def("profile_refresh_schedule")
    assert sched.cron_schedule == DEFAULT_PROFILE_REFRESH_CRON
    assert sched.job_name == "profile_refresh"
    monkeypatch.setenv("FLEXPIPE_PROFILE_REFRESH_CRON", "*/30 * * * *")
    assert profile_refresh_schedule().cron_schedule == "*/30 * * * *"
    ctx = build_schedule_context(instance=DagsterInstance.ephemeral())
    data = sched.evaluate_tick(ctx)
    assert len(data.run_requests) == 1


def test_real_probe_measures_cpu_workers_and_links():
    profile = ProberResource(probe=True, num_cpu_workers=2).get_profile()
    assert len(profile.devices) == 2 and len(profile.links) == 2
    for d in profile.devices:
        assert d.peak_tflops > 0 and d.hbm_bandwidth_gbps > 0 and d.max_micro_batch >= 1
        assert {"attention_t128", "mlp_t128"} <= set(d.op_timings_ms)
    assert all(link.bandwidth_gbps > 0 and link.latency_us > 0 for link in profile.links)
    if profile.devices[0].kind == "cpu-worker":
        assert any("CPU worker processes" in n for n in profile.notes)
        assert any(n.startswith("pynvml:") for n in profile.notes)  # the NVML failure is reported


def test_probe_merges_declared_inventory():
    profile = ProberResource(probe=True, num_cpu_workers=2,
                             cluster_file=str(EXAMPLES / "seed_example.yaml")).get_profile()
    assert profile.source == "merged" and profile.cluster_id == "seed-cluster"
    assert len(profile.devices) == 4 + 2


def test_cli_profile_json_and_errors(tmp_path, capsys):
    assert cli_main(["profile", "--cluster", str(EXAMPLES / "fragmented_lab.yaml"), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    lab = load_cluster_profile(EXAMPLES / "fragmented_lab.yaml")
    n = len(lab.devices)
    # the fleet form stores its hosts and tiers, and every ordered pair is derived from them
    assert len(doc["devices"]) == n and doc["links"] == [] and len(doc["topology"]["hosts"]) == 4
    assert "profile version 1" in captured.err
    again = tmp_path / "printed.json"
    again.write_text(captured.out)  # what --json prints loads back as a cluster file
    assert cli_main(["profile", "--cluster", str(again), "--no-store"]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - {node_id: a, memory_gb: -1, compute_score: 1}\n")
    assert cli_main(["profile", "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "nodes[0].memory_gb" in err and str(bad) in err and len(err.strip().splitlines()) == 1
    assert cli_main(["profile"]) == 2


@pytest.mark.gpu
def test_probe_on_cuda_writes_fixture():
    """On a CUDA host: the probe runs on the GPUs with NCCL; its output is kept as a test fixture."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this host: the GPU probe runs where one is available")
    from tests.support import REPO

    profile = ProberResource(probe=True).get_profile()
    assert all(d.kind == "cuda" for d in profile.devices)
    assert all(d.facts["nvml"].get("name") for d in profile.devices)
    out = REPO / "tests" / "fixtures" / "probe_cuda.json"
    out.write_text(json.dumps(profile.to_dict(), indent=1))
