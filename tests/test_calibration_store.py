"""Store: observed stage steps and calibration versions, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from flexpipe_dag.calibration import calibrate
from tests.test_calibration_fit import SPEC, cpu_cluster, synthetic_run


def test_observations_and_calibrations_round_trip(store):
    cluster = cpu_cluster(peak0=0.048)
    info = store.save_profile(cluster)
    observations = synthetic_run(cluster, {"cpu0": {"compute": 2.0, "memory": 1.0, "overhead": 30.0},
                                           "cpu1": {"compute": 1.0, "memory": 1.0, "overhead": 30.0}}, n=30)
    assert store.write_observations("run-1", observations[:40], cluster_key="cpu-host") == 40
    store.write_observations("run-2", observations[40:], cluster_key="cpu-host")
    assert store.read_observations() == observations
    assert store.read_observations(run_key="run-2") == observations[40:]
    assert [r["steps"] for r in store.observed_runs()] == [40, len(observations) - 40]
    cal = calibrate(SPEC, cluster, store.read_observations(cluster_key="cpu-host"), dtype="fp32")
    assert store.latest_calibration(info.id) is None
    assert store.save_calibration(info.id, cal, run_keys=["run-1", "run-2"])[1] == 1
    again = calibrate(SPEC, cluster, observations, dtype="fp32", prior=cal)
    cal_id, version = store.save_calibration(info.id, again)
    assert version == 2
    latest = store.latest_calibration(info.id, model_name=SPEC.name, dtype="fp32")
    assert latest.device_overrides() == again.device_overrides()
    rows = store.calibrations(info.id)
    assert [r.version for r in rows] == [1, 2] and rows[0].run_keys == ["run-1", "run-2"]
    assert set(rows[0].changed_devices) == {"cpu0", "cpu1"}
    # a calibration is stored beside the profile, whose raw rows stay as measured
    assert store.load_profile(info.id).devices == cluster.devices
    with pytest.raises(KeyError):
        store.save_calibration(info.id + 999, cal)
