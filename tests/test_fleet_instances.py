"""Several pipeline instances on this host behind one router (CPU, SmolLM2): load balancing, KV-aware
admission, scale-out and scale-in under load; nothing lost, nothing duplicated, greedy outputs unchanged.

Requests are the runtime tests' prompts (ids ``"<tag>-<prompt index>"``); every output is compared with
single-process transformers greedy ``generate`` (``hf_reference``) through the shift tests' :class:`Sink`.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.runtime.pipeline import RuntimeOptions, stage_memory_bytes
from flexpipe_dag.runtime.scheduler import Request
from flexpipe_dag.shift import InstanceFleet, ServingRouter, ShiftConfig
from tests.support import wait_until
from tests.test_runtime_helpers import checkpoint, gear, hf_reference, prompt_ids, requests
from tests.test_shift_executor import IDLE_TIMEOUT_S, Load, Sink

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Warm-up and deadlines of instance starts and removals, small for a loaded 2-core host.
FAST = ShiftConfig(warmup_requests=1, warmup_max_new_tokens=2, warmup_timeout_s=120.0, drain_timeout_s=60.0)


def _router(sink: Sink) -> ServingRouter:
    return ServingRouter(on_result=sink, on_refused=lambda rid, why: sink.refused.__setitem__(rid, why))


def _wait_idle(router: ServingRouter) -> None:
    assert router.wait_idle(timeout_s=IDLE_TIMEOUT_S), \
        f"timed out after {IDLE_TIMEOUT_S} s waiting for the router's {router.ledger.num_open()} open requests"


def _gone(pids) -> bool:
    return all(not os.path.exists(f"/proc/{pid}") for pid in pids)


def test_two_instances_share_requests_and_admit_by_kv_pool():
    ref = hf_reference()  # computed before the workers compete for the CPU
    sink = Sink()
    with _router(sink) as router:
        fleet = InstanceFleet(router, checkpoint(), config=FAST)
        big = fleet.add_instance(gear([(0, 30)], micro_batch_size=4, gear_id="one-stage"))
        # a 2-stage instance with a KV pool of 96 tokens: the longest request it holds is 97 tokens
        small = fleet.add_instance(gear([(0, 12), (12, 30)], micro_batch_size=4, kv_capacity_tokens=96,
                                        gear_id="two-stage"))
        status = {s.instance_id: s for s in fleet.instances}
        assert list(status) == [big, small] and status[big].entry_point and not status[small].entry_point
        assert status[small].longest_request_tokens == 97 and status[big].longest_request_tokens == 2049
        reqs = requests(prefix="f-")
        submitted = router.submit(reqs)
        _wait_idle(router)
        sink.check(submitted)
        led = router.ledger
        assert led.num_finished_by(big) > 0 and led.num_finished_by(small) > 0, "one instance got no work"
        assert led.counts()["moved"] == 0 and led.counts()["duplicates_dropped"] == 0

        # KV-aware admission: the small instance is the less loaded one, but cannot hold 100 tokens
        ids = list(prompt_ids()[0])
        blocker = router.submit([Request("busy-3", list(prompt_ids()[3]), 12, eos_token_ids=reqs[3].eos_token_ids)])
        assert led.get(blocker[0]).lane_id == big  # ties go to the entry point
        long = Request("long-0", ids, 100 - len(ids), eos_token_ids=reqs[0].eos_token_ids)
        router.submit([long])
        assert led.get("long-0").lanes == [big]
        # a request no instance can ever hold is refused by the router, with its numbers
        huge = Request("huge-0", ids, 3000, eos_token_ids=reqs[0].eos_token_ids)
        router.submit([huge])
        _wait_idle(router)
        why = sink.refused.pop("huge-0")
        assert "no instance can hold it" in why and f"= {len(ids) + 3000} tokens" in why, why
        assert f"{big} 2049" in why and f"{small} 97" in why, why
        assert sink.outputs["long-0"][:len(ref["0"])] == ref["0"] and sink.outputs["busy-3"] == ref["3"]
        assert set(sink.deliveries.values()) == {1}


def test_scale_out_then_scale_in_under_load_loses_nothing():
    hf_reference()
    sink = Sink()
    with _router(sink) as router:
        fleet = InstanceFleet(router, checkpoint(), config=FAST)
        first = fleet.add_instance(gear([(0, 30)], micro_batch_size=4, gear_id="first"))
        first_pids = router.lane(first).runtime.stage_pids()
        with Load(router, "o", interval_s=0.4, tail=4) as load:
            load.wait_submitted(4)
            assert router.ledger.num_open() > 0  # requests in flight while the new instance starts
            second = fleet.add_instance(gear([(0, 15), (15, 30)], micro_batch_size=4, gear_id="second"))
            at_add = len(load.submitted)
            wait_until(lambda: router.ledger.num_finished_by(second) > 0, IDLE_TIMEOUT_S,
                       "the added instance to finish a request", thread=load.thread)
            # scale in: the first instance (the entry point) leaves while it holds requests
            wait_until(lambda: router.ledger.num_open(first) > 0, IDLE_TIMEOUT_S,
                       "a request open on the first instance", thread=load.thread)
            removal = fleet.remove_instance(first)
            after_remove = len(load.submitted)
            load.wait_submitted(after_remove + 2)
        _wait_idle(router)
        print("scale out/in", removal, "submitted", len(load.submitted), "at add", at_add)
        sink.check(load.submitted)
        led = router.ledger
        assert removal.drained and removal.requests_moved == 0 and led.counts()["moved"] == 0
        assert router.lane(first).state == "retired" and _gone(first_pids)
        assert [s.instance_id for s in fleet.instances] == [second] and router.active is router.lane(second)
        late = load.submitted[after_remove:]
        assert late and all(led.get(rid).lanes == [second] for rid in late)  # none reached the withdrawn one
        assert led.num_finished_by(first) > 0 and led.num_finished_by(second) > 0


def test_removing_an_instance_that_cannot_drain_in_time_moves_its_requests():
    hf_reference()
    sink = Sink()
    with _router(sink) as router:
        fleet = InstanceFleet(router, checkpoint(), config=FAST)
        a = fleet.add_instance(gear([(0, 30)], micro_batch_size=2, gear_id="a"))
        b = fleet.add_instance(gear([(0, 30)], micro_batch_size=2, gear_id="b"))
        submitted = router.submit(requests(prefix="m-"))
        on_b = router.ledger.num_open(b)
        assert on_b > 0 and router.ledger.num_open(a) > 0
        removal = fleet.remove_instance(b, drain_timeout_s=0.0)  # stopped at once: its requests move to a
        _wait_idle(router)
        print("forced removal", removal, router.ledger.counts())
        sink.check(submitted)
        assert not removal.drained and removal.requests_moved > 0 and router.lane(b).state == "retired"
        assert router.ledger.counts()["moved"] == removal.requests_moved
        assert [s.instance_id for s in fleet.instances] == [a]
        with pytest.raises(InputError, match="last live instance"):
            fleet.remove_instance(a)
        # a third instance that would not fit beside the live one on cpu0 is refused before it starts
        one = stage_memory_bytes(router.lane(a).gear, checkpoint())[0]["total_bytes"]
        tight = RuntimeOptions(device_memory_bytes={"cpu0": int(1.5 * one / (1 - FAST.memory_reserve_fraction))})
        with pytest.raises(InfeasibleError, match=r"does not fit beside the live instances \['a#"):
            fleet.add_instance(gear([(0, 30)], micro_batch_size=2, gear_id="c"), options=tight)
        assert [s.instance_id for s in fleet.instances] == [a] and len(router.lanes) == 2
