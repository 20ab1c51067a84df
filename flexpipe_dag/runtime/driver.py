"""The driver process (rank 0): scheduler, micro-batch dispatch, results, live metrics, reconfiguration.

Commands arrive from the parent on ``cmd_q`` (:mod:`~flexpipe_dag.runtime.messages`):

* :class:`~flexpipe_dag.runtime.messages.AddRequests` - queue requests;
* :class:`~flexpipe_dag.runtime.messages.AbortRequests` - end requests nobody waits for (their KV
  blocks freed);
* :class:`~flexpipe_dag.runtime.messages.Reconfigure` - pause admission, drain running sequences
  (in-flight work finishes), send ``RECONFIGURE`` down the stages, resume with a fresh KV allocator
  once every last-stage replica confirms; queued requests wait meanwhile;
* :class:`~flexpipe_dag.runtime.messages.FlushMetrics` - emit a metrics sample now (covering the
  time since the last one);
* :class:`~flexpipe_dag.runtime.messages.StopPipeline` - drain, then stop every stage.

Events go to the parent on ``evt_q``: ``TokensGenerated`` (streaming only), ``RequestFinished``, ``MetricsSampled``, ``Reconfigured``,
``RequestRefused``, ``ProcessFailed("driver", ...)``, ``Stopped``.

:class:`Driver` has one method per event; :func:`driver_main` is the process entry point.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from flexpipe_dag.runtime.lifeline import follow_parent
from flexpipe_dag.runtime.messages import (
    AbortRequests,
    AddRequests,
    DriverCounter,
    FlushMetrics,
    MessageKind,
    MetricsSampled,
    ProcessFailed,
    Reconfigure,
    Reconfigured,
    RequestFinished,
    RequestRefused,
    SchedulerConfig,
    StageInfo,
    StageReload,
    StepResult,
    Stopped,
    StopPipeline,
    TokensGenerated,
    WorkerCounter,
    counter_index,
)
from flexpipe_dag.runtime.worker import WorkerSpec, setup_process

#: Seconds an idle driver sleeps between polls when nothing is queued or running.
_IDLE_SLEEP_S = 0.01


class Driver:
    """The driver's state and its reactions, one method per event. Runs in the driver process after
    :func:`~flexpipe_dag.runtime.worker.setup_process` (it sends and receives on the process group).

    Args:
        spec: the pipeline's :class:`~flexpipe_dag.runtime.worker.WorkerSpec` (ranks, KV geometry).
        gear_id: the gear served (names metric samples until a reconfiguration changes it).
        config: the scheduler's :class:`~flexpipe_dag.runtime.messages.SchedulerConfig`.
        evt_q: where events for the parent go.
        counters: the shared counter array (this rank's :class:`DriverCounter` slots are written;
            the workers' :class:`WorkerCounter` slots are read for metrics).
        metrics_period_s: seconds between metric samples.

    Attributes:
        in_transport: a send / receive is under way (a failure now is likely a peer's death).
    """

    def __init__(self, spec: WorkerSpec, gear_id: str, config: SchedulerConfig, evt_q, counters,
                 metrics_period_s: float):
        from flexpipe_dag.runtime import transport
        from flexpipe_dag.runtime.kv_blocks import BlockAllocator, KVCapacityError
        from flexpipe_dag.runtime.live_metrics import LiveMetrics
        from flexpipe_dag.runtime.scheduler import Scheduler

        self._tp = transport
        self.spec, self.evt_q, self.counters = spec, evt_q, counters
        self.metrics_period_s = metrics_period_s
        self.stream_tokens = config.stream_tokens
        self.layout = spec.layout()
        n = spec.num_stages
        self.first_ranks = [self.layout.rank(0, k) for k in range(self.layout.replicas[0])]
        self.last_ranks = [self.layout.rank(n - 1, k) for k in range(self.layout.replicas[-1])]
        self.scheduler = Scheduler(BlockAllocator(self.layout.num_blocks, spec.block_size_tokens, self.layout.num_lanes),
                                   micro_batch_size=config.micro_batch_size,
                                   max_inflight_micro_batches=config.max_inflight_micro_batches,
                                   max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
                                   max_context_tokens=config.max_context_tokens,
                                   stage_replicas=self.layout.replicas,
                                   kv_capacity_knob=config.kv_capacity_knob,
                                   chunked_prefill=config.chunked_prefill)
        self.metrics = LiveMetrics(gear_id, time.monotonic())
        self.inbox: queue.Queue = queue.Queue()  # (MessageKind, payload) from the last stage, or an exception
        self.next_sample = time.monotonic() + metrics_period_s
        self.pending_reconfigure: Reconfigure | None = None
        self.reconfigure_sent = False
        self.confirmations: dict[tuple[int, int], StageInfo] = {}
        self.stopping = False
        self.sent = 0  # micro-batches sent into the pipeline
        self.in_transport = False
        # what add_request raises for a request it will not serve (ValueError covers ContextLengthError, InputError)
        self._refusals = (KVCapacityError, ValueError)
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddRequests: self.on_add, AbortRequests: self.on_abort, Reconfigure: self.on_reconfigure,
            FlushMetrics: self.on_flush, StopPipeline: self.on_stop}

    # -- main loop ------------------------------------------------------------------------------
    def run(self, cmd_q) -> None:
        """Serve until a :class:`StopPipeline` has drained and stopped every stage.

        Raises:
            BaseException: whatever a send, the receiver thread or the scheduler raised.
        """
        threading.Thread(target=self._receive, name="flexpipe-driver-recv", daemon=True).start()
        while True:
            self.take_commands(cmd_q)
            self.dispatch()
            if self.drained and self.pending_reconfigure is not None and not self.reconfigure_sent:
                self.send_reconfigure()
            if self.stopping and self.drained and self.pending_reconfigure is None:
                self.stop_stages()  # queued requests are dropped on stop
                return
            self.take_one_message()
            now = time.monotonic()
            if now >= self.next_sample:
                self.on_sample_due(now)

    @property
    def drained(self) -> bool:
        """No sequence running and no micro-batch in flight."""
        return self.scheduler.num_running == 0 and self.scheduler.num_inflight_micro_batches == 0

    def _send(self, dst: int, kind: MessageKind, payload=None, tensor=None) -> None:
        self.in_transport = True
        self._tp.send_message(dst, kind, payload, tensor)
        self.in_transport = False

    def _receive(self) -> None:
        """Receiver thread: messages of the last stage's replicas into :attr:`inbox` (the driver's
        messages travel in host memory, gloo, on every backend). Stops after every replica's ``STOP``."""
        tp, stops = self._tp, 0
        inbox = tp.Inbox(self.last_ranks[0] if len(self.last_ranks) == 1 else None)
        try:
            while True:
                _src, kind, meta, _ = inbox.recv()
                if kind == MessageKind.STOP:
                    stops += 1
                    if stops == len(self.last_ranks):
                        self.inbox.put((kind, meta))
                        return
                    continue
                self.inbox.put((kind, meta))
        except BaseException as exc:
            self.inbox.put(exc)

    # -- commands from the parent ---------------------------------------------------------------
    def take_commands(self, cmd_q) -> None:
        """Apply every command waiting on ``cmd_q``."""
        try:
            while True:
                cmd = cmd_q.get_nowait()
                self._handlers[type(cmd)](cmd)
        except queue.Empty:
            pass

    def on_add(self, cmd: AddRequests) -> None:
        """Queue each request; a refused one is reported as :class:`RequestRefused`."""
        for req in cmd.requests:
            if not req.probe:  # refused ones too: rps is the online load offered; a probe is nobody's traffic
                self.metrics.record_arrivals(1, req.priority)
            try:
                self.scheduler.add_request(req)
            except self._refusals as exc:
                self.evt_q.put(RequestRefused(req.request_id, str(exc)))

    def on_abort(self, cmd: AbortRequests) -> None:
        """End the requests (those in a micro-batch in flight end when it comes back: :meth:`on_result`)."""
        for out in self.scheduler.abort(cmd.request_ids):
            self.evt_q.put(RequestFinished(out))

    def on_reconfigure(self, cmd: Reconfigure) -> None:
        """Pause admission; the stages reload once running sequences drained (:meth:`send_reconfigure`)."""
        self.pending_reconfigure, self.reconfigure_sent = cmd, False
        self.scheduler.admission_paused = True

    def on_flush(self, cmd: FlushMetrics) -> None:
        """Sample metrics at the next opportunity."""
        self.next_sample = 0.0

    def on_stop(self, cmd: StopPipeline) -> None:
        """Pause admission; stop once running sequences drained (and any reconfiguration finished)."""
        self.stopping = True
        self.scheduler.admission_paused = True

    # -- the pipeline ---------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Send every micro-batch the scheduler is ready to run to stage 0 of its lane."""
        while (mb := self.scheduler.schedule()) is not None:
            self._send(self.layout.lane_rank(0, mb.lane), MessageKind.BATCH, mb, self._tp.batch_input_ids(mb))
            self.sent += 1
            self.counters[counter_index(0, DriverCounter.MICRO_BATCHES_SENT)] = self.sent

    def send_reconfigure(self) -> None:
        """Send the pending :class:`Reconfigure` down every lane (the pipeline is drained).

        Raises:
            RuntimeError: no reconfiguration is pending.
        """
        cmd = self.pending_reconfigure
        if cmd is None:
            raise RuntimeError("driver: no reconfiguration pending to send")
        for dst in self.first_ranks:
            self._send(dst, MessageKind.RECONFIGURE, StageReload(cmd))
        self.reconfigure_sent = True
        self.confirmations = {}

    def stop_stages(self) -> None:
        """Send ``STOP`` down every lane, wait until it came back from every last-stage replica, then
        report :class:`Stopped`.

        Raises:
            BaseException: the receiver thread's failure.
        """
        for dst in self.first_ranks:
            self._send(dst, MessageKind.STOP, None)
        while True:
            item = self.inbox.get(timeout=600)
            if isinstance(item, BaseException):
                raise item
            if item[0] == MessageKind.STOP:
                break
        self.evt_q.put(Stopped())

    def take_one_message(self) -> None:
        """Handle the next message from the last stage, waiting briefly for one (longer while work is
        in flight); sleep a little when there is nothing at all to do.

        Raises:
            BaseException: the receiver thread's failure (counted as a transport failure).
        """
        busy = self.scheduler.num_inflight_micro_batches > 0
        try:
            item = self.inbox.get(timeout=0.02 if busy or self.reconfigure_sent else 0.005)
        except queue.Empty:
            if not busy and not self.scheduler.has_unfinished():
                time.sleep(_IDLE_SLEEP_S)
            return
        if isinstance(item, BaseException):
            self.in_transport = True
            raise item
        kind, payload = item
        if kind == MessageKind.RESULT:
            self.on_result(payload)
        elif kind == MessageKind.RECONFIGURED:
            self.on_reconfigured(payload)

    def on_result(self, result: StepResult) -> None:
        """A micro-batch's sampled tokens: advance its sequences, report those that finished."""
        self.metrics.record_tokens(len(result.token_ids))
        sampled: list[tuple[str, int, int]] = []
        finished = self.scheduler.update_from_output(result.mb_id, list(result.token_ids),
                                                     on_token=(lambda *t: sampled.append(t))
                                                     if self.stream_tokens else None)
        if sampled:  # before the finished requests: a stream sees its last token, then the end
            self.evt_q.put(TokensGenerated(tuple(sampled)))
        for out in finished:
            if out.finish_reason != "abort" and not out.probe:  # an aborted request's latencies are not the pipeline's
                self.metrics.record_finished(out.ttft_s, out.tpot_s, out.e2e_s, out.priority)
            self.evt_q.put(RequestFinished(out))
        self.counters[counter_index(0, DriverCounter.MICRO_BATCHES_DONE)] += 1

    def on_reconfigured(self, reload: StageReload) -> None:
        """One last-stage replica confirmed; once every worker has, adopt the new KV geometry and
        scheduler limits, report :class:`Reconfigured` and resume admission (unless stopping).

        Raises:
            RuntimeError: no reconfiguration is pending (the stages confirmed one never sent).
        """
        cmd = self.pending_reconfigure
        if cmd is None:
            raise RuntimeError("driver: a last stage confirmed a reconfiguration, but none is pending")
        for info in reload.infos:
            self.confirmations[info.slot] = info
        if len(self.confirmations) < self.layout.num_workers:
            return  # another last-stage replica has yet to confirm
        self.layout = self.spec.layout(cmd.num_blocks)
        sched = self.scheduler
        sched.allocator.reset(self.layout.num_blocks, cmd.block_size_tokens, self.layout.num_lanes)
        sched.micro_batch_size = cmd.micro_batch_size
        sched.max_inflight_micro_batches = cmd.max_inflight_micro_batches
        self.metrics.gear_id = cmd.gear_id
        self.evt_q.put(Reconfigured(tuple(self.confirmations.values())))
        self.pending_reconfigure, self.reconfigure_sent = None, False
        sched.admission_paused = self.stopping

    # -- metrics --------------------------------------------------------------------------------
    def on_sample_due(self, now: float) -> None:
        """Emit a :class:`MetricsSampled` for the window since the last one."""
        from flexpipe_dag.runtime.live_metrics import StageCounters

        c, layout, sched = self.counters, self.layout, self.scheduler

        def total(stage: int, slot: WorkerCounter) -> float:
            return sum(c[counter_index(layout.rank(stage, k), slot)] for k in range(layout.replicas[stage]))

        # a replicated stage: its steps summed, busy time averaged over replicas
        stages = [StageCounters(int(total(s, WorkerCounter.STEPS)), float(total(s, WorkerCounter.BUSY_S)
                                                                          / layout.replicas[s]))
                  for s in range(self.spec.num_stages)]
        self.evt_q.put(MetricsSampled(self.metrics.sample(
            now, queue_length=sched.num_waiting, running=sched.num_running,
            kv_blocks_used=sched.allocator.num_used_blocks, kv_blocks_total=sched.allocator.num_blocks,
            micro_batches_sent=self.sent, stages=stages)))
        self.next_sample = now + self.metrics_period_s



def driver_main(spec: WorkerSpec, gear_id: str, config: SchedulerConfig, cmd_q, evt_q, counters,
                metrics_period_s: float) -> None:
    """Entry point of the driver process (rank 0): run a :class:`Driver` until it stops; on any
    failure report :class:`ProcessFailed` ``("driver", ...)`` and exit non-zero."""
    follow_parent()  # leave with the head, however it ends; Ctrl-C is the head's to handle
    driver: Driver | None = None
    try:
        setup_process(spec, 0)
        driver = Driver(spec, gear_id, config, evt_q, counters, metrics_period_s)
        driver.run(cmd_q)
    except BaseException as exc:
        evt_q.put(ProcessFailed("driver", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}",
                                driver is not None and driver.in_transport))
        raise SystemExit(1) from None
    finally:
        from flexpipe_dag.runtime.worker import _destroy

        _destroy()
