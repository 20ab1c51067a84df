"""Live fleet gears (issue 20, items 3 and 5): the fleet scaler's decisions applied to real pipeline instances
behind one router on this host (CPU, SmolLM2): a scale-out adds an instance under load, a scale-in drains
and removes it; every greedy output exact, nothing lost or duplicated."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from flexpipe_dag.control.fleet_scaler import FleetScalerConfig
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.fleet import FleetInstance, FleetPlan
from flexpipe_dag.shift import InstanceFleet, ServingRouter
from flexpipe_dag.shift.fleet_control import _COUNTED, FleetController
from tests.support import wait_until
from tests.test_fleet_instances import FAST
from tests.test_runtime_helpers import checkpoint, gear, hf_reference
from tests.test_shift_executor import IDLE_TIMEOUT_S, Load, Sink

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Every figure at its quickest: one sample decides, no dwell; the rates are given, not measured.
QUICK = FleetScalerConfig(sample_period_s=1.0, rps_ema_alpha=1.0, hysteresis_samples=1, dwell_s=1.0,
                          scale_out_dwell_s=0.0, forecast_horizon_s=0.0, instance_warmup_s=0.0,
                          instance_drain_s=0.0, payback_factor=0.0)


def _plan() -> FleetPlan:
    """Two one-stage SmolLM2 instances, on cpu0 and cpu1, each with an envelope of 1 req/s."""
    instances = tuple(
        FleetInstance(instance_id=f"i{k}", host_ids=("localhost",), template=0,
                      gear=gear([(0, 30)], micro_batch_size=4, gear_id=f"i{k}", device_ids=[[f"cpu{k}"]])
                      .model_copy(update={"rps_max": 1.0}))
        for k in range(2))
    return FleetPlan(cluster_id="this-host", templates=(), instances=instances)


def test_the_fleet_scaler_adds_and_removes_live_instances_under_load():
    hf_reference()
    sink = Sink()
    with ServingRouter(on_result=sink, on_refused=lambda rid, why: sink.refused.__setitem__(rid, why)) as router:
        fleet = InstanceFleet(router, checkpoint(), config=FAST)
        ctl = FleetController(fleet, _plan(), QUICK)
        with pytest.raises(InputError, match="start"):
            ctl.step(0.0, 0.5)
        first, = ctl.start(0.5)                                  # 0.5 req/s: one instance holds it
        with Load(router, "c", interval_s=0.4, tail=4) as load:
            load.wait_submitted(3)
            up = ctl.step(1.0, 1.5)                              # 1.5 / 0.95 > 1: scale out
            assert (up.from_instances, up.to_instances, up.reason_kind) == (1, 2, "scale_out"), up.reason
            second = ctl.lane_ids[1]
            wait_until(lambda: router.ledger.num_finished_by(second) > 0, IDLE_TIMEOUT_S,
                       "the added instance to finish a request", thread=load.thread)
            wait_until(lambda: router.ledger.num_open(second) > 0, IDLE_TIMEOUT_S,
                       "a request open on the second instance", thread=load.thread)
            down = ctl.step(3.0, 0.3)                            # 0.3 < 0.85 x 1: scale in, drains it
            assert (down.to_instances, down.reason_kind) == (1, "scale_in"), down.reason
            after = len(load.submitted)
            load.wait_submitted(after + 2)
        assert router.wait_idle(timeout_s=IDLE_TIMEOUT_S)
        sink.check(load.submitted)                               # every output exact, each delivered once
        led = router.ledger
        assert led.counts()["moved"] == 0 and led.num_finished_by(second) > 0
        assert [s.instance_id for s in fleet.instances] == [first] and ctl.lane_ids == [first]
        assert all(led.get(rid).lanes == [first] for rid in load.submitted[after:])
        assert [d.reason_kind for d in ctl.decisions] == ["scale_out", "scale_in"] and not ctl.errors


def test_a_start_that_fails_is_retried_after_a_warm_up_not_at_every_sample():
    """An instance that cannot start (no room) is recorded once, the fleet keeps what serves, and the next
    attempt waits one warm-up: a server sampling every 2 s logged the same refusal at every sample."""
    from types import SimpleNamespace

    from flexpipe_dag.core.errors import InfeasibleError

    class NoRoom:
        def __init__(self):
            ledger = SimpleNamespace(counts=lambda: dict.fromkeys(_COUNTED, 0),
                                     num_open=lambda: 0)
            self.router = SimpleNamespace(ledger=ledger, instances=[SimpleNamespace(lane_id="a")])
            self.attempts = 0

        def add_instance(self, gear, options=None):
            self.attempts += 1
            raise InfeasibleError("no room for another instance")

    fleet = NoRoom()
    cfg = QUICK.model_copy(update={"instance_warmup_s": 30.0, "trend_beta": 0.0})
    ctl = FleetController(fleet, _plan(), cfg, clock=lambda: 0.0)  # type: ignore[arg-type]
    ctl.adopt(["a"])
    for t in (1.0, 2.0, 3.0, 20.0):
        ctl.step(t, rps=5.0)
    assert fleet.attempts == 1 and len(ctl.errors) == 1 and "no room" in ctl.errors[0]
    assert ctl.state is not None and ctl.state.instances == 1 and ctl.lane_ids == ["a"]
    ctl.step(31.5, rps=5.0)
    assert fleet.attempts == 2
