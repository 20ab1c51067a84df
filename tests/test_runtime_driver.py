"""The driver's reconfiguration bookkeeping, without processes (its sends are captured)."""

from __future__ import annotations

import queue

import pytest

pytest.importorskip("torch")

from flexpipe_dag.runtime.driver import Driver
from flexpipe_dag.runtime.messages import (
    COUNTER_SLOTS,
    AbortRequests,
    AddRequests,
    MessageKind,
    Reconfigure,
    Reconfigured,
    RequestFinished,
    SchedulerConfig,
    StageInfo,
    StageReload,
    StepResult,
    TokensGenerated,
)
from flexpipe_dag.runtime.scheduler import Request
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


def test_an_abort_ends_queued_and_running_requests_now_and_in_flight_ones_when_their_step_returns():
    driver, events, sent = make_driver()
    driver.stream_tokens = True
    cmds: queue.Queue = queue.Queue()
    cmds.put(AddRequests(tuple(Request(rid, [1, 2, 3], 10) for rid in ("a", "b"))))  # 3 of the 8 blocks each
    driver.take_commands(cmds)
    driver.dispatch()  # one micro-batch of both (micro-batch size 2)
    (batch,) = [payload for _, kind, payload in sent if kind == MessageKind.BATCH]
    cmds.put(AbortRequests(("a", "unknown")))
    driver.take_commands(cmds)
    assert events.empty()  # "a" is in flight: it ends when its step comes back
    driver.on_result(StepResult(batch.mb_id, (11, 12)))
    tokens, finished = events.get_nowait(), events.get_nowait()
    assert isinstance(tokens, TokensGenerated) and tokens.tokens == (("b", 0, 12),)  # "a"'s token is not sent
    assert isinstance(finished, RequestFinished) and finished.output.request_id == "a"
    assert finished.output.finish_reason == "abort" and finished.output.output_token_ids == []
    cmds.put(AbortRequests(("b",)))  # not in flight now: ends at once, with its token
    driver.take_commands(cmds)
    out = events.get_nowait().output
    assert (out.request_id, out.finish_reason, out.output_token_ids) == ("b", "abort", [12])
    assert driver.drained and driver.scheduler.allocator.num_used_blocks == 0
    sample = driver.metrics.sample(1.0, queue_length=0, running=0, kv_blocks_used=0, kv_blocks_total=8,
                                   micro_batches_sent=1, stages=[])
    assert sample.completed == 0 and sample.ttft_p99_ms is None  # an aborted request is not a completed one


def test_a_probe_is_served_but_never_counted_as_online_traffic():
    """A shift's or a new instance's warm-up / verification request (``probe``) is nobody's traffic: before,
    a second instance's warm-up read in the store as an online arrival with a completion and a TTFT."""
    driver, events, sent = make_driver()
    cmds: queue.Queue = queue.Queue()
    cmds.put(AddRequests((Request("probe-1", [1, 2, 3], 1, probe=True), Request("client-1", [4, 5], 1))))
    driver.take_commands(cmds)
    driver.dispatch()
    (batch,) = [payload for _, kind, payload in sent if kind == MessageKind.BATCH]
    driver.on_result(StepResult(batch.mb_id, (11, 12)))
    outs = {ev.output.request_id: ev.output for ev in (events.get_nowait(), events.get_nowait())}
    assert outs["probe-1"].probe and not outs["client-1"].probe
    assert [o.finish_reason for o in outs.values()] == ["length", "length"]  # both served
    sample = driver.metrics.sample(driver.metrics.start_s + 2.0, queue_length=0, running=0, kv_blocks_used=0,
                                   kv_blocks_total=8, micro_batches_sent=1, stages=[])
    assert sample.rps == pytest.approx(1 / 2.0) and sample.completed == 1  # the client's request only
    assert sample.tokens_per_s == pytest.approx(2 / 2.0)  # output tokens: every token the pipeline produced
