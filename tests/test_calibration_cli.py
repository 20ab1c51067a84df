"""``flexpipe calibrate``: fit from stored observations, store a version, report fidelity; clear errors."""

from __future__ import annotations

from flexpipe_dag.cli import main
from tests.test_calibration_fit import cpu_cluster, synthetic_run


def test_calibrate_then_report(capsys):
    from flexpipe_dag.sql.store import Store

    store = Store.from_url()
    assert main(["calibrate"]) == 2  # nothing observed yet
    assert "no observed steps" in capsys.readouterr().err
    cluster = cpu_cluster(peak0=0.048)
    info = store.save_profile(cluster)
    obs = synthetic_run(cluster, {"cpu0": {"compute": 2.0, "memory": 1.0, "overhead": 30.0},
                                  "cpu1": {"compute": 1.0, "memory": 1.0, "overhead": 30.0}}, n=40)
    store.write_observations("run-a", obs, cluster_key=cluster.cluster_id)
    assert main(["calibrate", "--dry-run"]) == 0
    assert store.calibrations(info.id) == []
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "cpu0: compute" in out and "stored as calibration version 1" in out
    assert main(["calibrate", "--report"]) == 0
    report = capsys.readouterr().out
    assert "stage_time" in report and "tpot_service" in report and "ttft_service" in report
    rows = [link.split() for link in report.splitlines() if link.startswith("g ")]
    assert {r[1] for r in rows} == {"stage_time", "ttft_service", "tpot_service"}
    assert len([r for r in rows if r[1] == "stage_time"]) == 4  # 2 stages x (prefill, decode)
    assert main(["calibrate", "--cluster-id", "nope"]) == 2
    assert store.load_profile(info.id).devices == cluster.devices
