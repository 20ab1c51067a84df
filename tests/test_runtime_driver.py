"""The driver's reconfiguration bookkeeping, without processes (its sends are captured)."""

from __future__ import annotations

import queue

import pytest

pytest.importorskip("torch")

from flexpipe_dag.runtime.driver import Driver
from flexpipe_dag.runtime.messages import (
    COUNTER_SLOTS,
    MessageKind,
    Reconfigure,
    Reconfigured,
    SchedulerConfig,
    StageInfo,
    StageReload,
)
from flexpipe_dag.runtime.worker import WorkerSpec


def make_driver() -> tuple[Driver, queue.Queue, list]:
    spec = WorkerSpec(checkpoint_path="unused", checkpoint_name="unused", ranges=[(0, 2), (2, 4)], num_blocks=8,
                      block_size_tokens=4)
    events: queue.Queue = queue.Queue()
    driver = Driver(spec, "g0", SchedulerConfig(micro_batch_size=2, max_inflight_micro_batches=2,
                                                max_tokens_per_micro_batch=64),
                    events, [0.0] * (COUNTER_SLOTS * spec.world_size), metrics_period_s=60.0)
    sent: list = []
    driver._send = lambda dst, kind, payload=None, tensor=None: sent.append((dst, kind, payload))
    return driver, events, sent


def info(stage: int, a: int, b: int) -> StageInfo:
    return StageInfo(stage_index=stage, replica_index=0, layer_start=a, layer_end=b, param_bytes=1, kv_pool_bytes=1,
                     kv_capacity_tokens=64, pid=1, host="h")


def test_reconfiguration_is_sent_then_adopted_once_every_stage_confirmed():
    driver, events, sent = make_driver()
    cmd = Reconfigure("g1", ((0, 1), (1, 4)), 16, 8, 3, 1)
    driver.on_reconfigure(cmd)
    assert driver.scheduler.admission_paused
    driver.send_reconfigure()
    assert sent == [(1, MessageKind.RECONFIGURE, StageReload(cmd))]
    driver.on_reconfigured(StageReload(cmd, (info(0, 0, 1),)))  # one worker of two: not yet
    assert driver.pending_reconfigure is cmd and events.empty()
    driver.on_reconfigured(StageReload(cmd, (info(0, 0, 1), info(1, 1, 4))))
    assert driver.pending_reconfigure is None and not driver.scheduler.admission_paused
    alloc = driver.scheduler.allocator
    assert (alloc.num_blocks, alloc.block_size_tokens, driver.scheduler.micro_batch_size) == (16, 8, 3)
    assert driver.metrics.gear_id == "g1"
    ev = events.get_nowait()
    assert isinstance(ev, Reconfigured) and [i.layer_end for i in ev.infos] == [1, 4]


def test_reconfiguration_messages_without_one_pending_are_refused_by_name():
    driver, _events, sent = make_driver()
    with pytest.raises(RuntimeError, match="no reconfiguration pending"):
        driver.send_reconfigure()
    assert not sent
    with pytest.raises(RuntimeError, match="none is pending"):
        driver.on_reconfigured(StageReload(Reconfigure("g1", ((0, 1), (1, 4)), 16, 8, 3, 1), (info(0, 0, 1),)))
