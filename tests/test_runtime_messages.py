"""Typed messages between runtime processes: JSON round trips, and clear refusals of malformed input."""

from __future__ import annotations

import queue

import pytest

from flexpipe_dag.runtime.messages import (
    COUNTER_SLOTS,
    DriverCounter,
    MessageError,
    MessageKind,
    ProcessFailed,
    Reconfigure,
    SchedulerConfig,
    StageInfo,
    StageReady,
    StageReload,
    StepResult,
    WorkerCounter,
    counter_index,
    from_json,
    to_json,
)
from flexpipe_dag.runtime.scheduler import MicroBatch, ScheduledSeq

INFO = StageInfo(stage_index=1, replica_index=0, layer_start=15, layer_end=30, param_bytes=10, kv_pool_bytes=20,
                 kv_capacity_tokens=128, pid=42, host="h", observations_path=None)


@pytest.mark.parametrize("msg", [
    MicroBatch(3, [ScheduledSeq(7, [1, 2, 3], 0, [0, 1], 0, temperature=0.7, top_k=5, top_p=0.9, seed=11)], lane=1),
    StepResult(3, (5, 6)),
    StageReload(Reconfigure("g", ((0, 15), (15, 30)), 8, 16, 4, 2), (INFO,)),
    StageReady(1, INFO),
    ProcessFailed("driver", "boom", True),
    ProcessFailed(2, "boom", False),
], ids=lambda m: type(m).__name__)
def test_messages_round_trip_through_json(msg):
    assert from_json(type(msg), to_json(msg)) == msg


def test_worker_spec_round_trips():
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.worker import WorkerSpec

    spec = WorkerSpec("/m", "m", [(0, 15), (15, 30)], 8, 16, replicas=[1, 2], fault={"stage": 1, "raise_after_steps": 2})
    assert from_json(WorkerSpec, to_json(spec)) == spec


@pytest.mark.parametrize("blob,match", [
    (b"\x80\x04pickle", "not JSON"),
    (b'{"type":"Evil","value":{}}', "expected StepResult, got type 'Evil'"),
    (b'{"type":"StepResult","value":{"mb_id":"3","token_ids":[]}}', r"StepResult from rank 2\.mb_id: expected an integer"),
    (b'{"type":"StepResult","value":{"mb_id":3}}', r"missing field\(s\) \['token_ids'\]"),
    (b'{"type":"StepResult","value":{"mb_id":3,"token_ids":[],"x":1}}', r"unknown field\(s\) \['x'\]"),
    (b'{"type":"StepResult","value":{"mb_id":true,"token_ids":[]}}', "expected an integer, got True"),
])
def test_malformed_messages_are_refused_with_a_clear_error(blob, match):
    with pytest.raises(MessageError, match=match):
        from_json(StepResult, blob, "rank 2")


def test_kinds_counters_and_config():
    assert MessageKind(4).name == "RECONFIGURED"
    assert max(DriverCounter) < COUNTER_SLOTS and max(WorkerCounter) < COUNTER_SLOTS
    assert counter_index(2, WorkerCounter.STEP_STARTED) == 2 * COUNTER_SLOTS + 2
    assert INFO.slot == (1, 0) and INFO.as_dict()["layer_end"] == 30
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        SchedulerConfig(micro_batch_size=0, max_inflight_micro_batches=1)


def test_control_store_drops_a_malformed_event_and_goes_on():
    """A malformed event, or one naming another worker slot, is dropped and counted; the pump goes on."""
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.remote import ControlServer, connect

    server = ControlServer(0, 2)
    try:
        store = connect("127.0.0.1", server.port, 10, server.secret)
        store.claim(0)
        store.queue_push("events/0", to_json(StageReady(0, INFO)))
        events: queue.Queue = queue.Queue()
        server.poll(events, [0.0] * 12)
        assert events.get_nowait() == StageReady(0, INFO) and server.workers[0].pid == 42
        store.queue_push("events/0", b'{"type":"StageReady","value":{"worker":9}}')
        store.queue_push("events/0", to_json(StageReady(1, INFO)))  # slot 0 speaking for slot 1
        store.queue_push("events/0", to_json(ProcessFailed(0, "boom", False)))
        server.poll(events, [0.0] * 12)
        assert events.get_nowait() == ProcessFailed(0, "boom", False) and events.empty()
        assert server.ignored == {(0, "event"): 2}
    finally:
        server.close()
