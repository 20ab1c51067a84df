"""The driver process (rank 0): scheduler, micro-batch dispatch, results, live metrics, reconfiguration.

Commands arrive from the parent on ``cmd_q``:

* ``("add", [Request, ...])`` - queue requests;
* ``("reconfigure", {"ranges", "num_blocks", "block_size_tokens", "gear_id"})`` - pause admission,
  drain running sequences (in-flight work finishes), send ``RECONFIGURE`` down the stages, resume
  with a fresh KV allocator once the last stage confirms; queued requests wait meanwhile;
* ``("flush", None)`` - emit a metrics sample now (covering the time since the last one);
* ``("stop", None)`` - drain, then stop every stage.

Events go to the parent on ``evt_q``: ``("result", RequestOutput)``, ``("metrics", MetricSample)``,
``("reconfigured", [stage info])``, ``("refused", request_id, reason)``, ``("error", "driver", msg, transport)``,
``("stopped",)``.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback

from flexpipe_dag.runtime.worker import F_AUX, F_BUSY_S, F_STEPS, FIELDS, WorkerSpec, setup_process, worker_slot


def driver_main(spec: WorkerSpec, gear_id: str, sched_cfg: dict, cmd_q, evt_q, counters,
                metrics_period_s: float) -> None:
    """Entry point of the driver process; see the module docstring for the protocol."""
    in_transport = False
    try:
        setup_process(spec, 0)
        from flexpipe_dag.runtime import transport as tp
        from flexpipe_dag.runtime.kv_blocks import BlockAllocator, KVCapacityError
        from flexpipe_dag.runtime.live_metrics import LiveMetrics, StageCounters
        from flexpipe_dag.runtime.scheduler import Scheduler

        layout = spec.layout()
        n = spec.num_stages
        first_ranks = [layout.rank(0, k) for k in range(layout.replicas[0])]
        last_ranks = [layout.rank(n - 1, k) for k in range(layout.replicas[-1])]
        sched = Scheduler(BlockAllocator(layout.num_blocks, spec.block_size_tokens, layout.num_lanes), **sched_cfg)
        inbox: queue.Queue = queue.Queue()

        def receive() -> None:  # the driver's messages travel in host memory (gloo) on every backend
            stops = 0
            try:
                while True:
                    if len(last_ranks) == 1:
                        kind, meta, _ = tp.recv_message(last_ranks[0])
                    else:
                        _src, kind, meta, _ = tp.recv_message_any()
                    if kind == tp.STOP:
                        stops += 1
                        if stops == len(last_ranks):
                            inbox.put((kind, meta))
                            return
                        continue
                    inbox.put((kind, meta))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                inbox.put(("error", exc))

        threading.Thread(target=receive, name="flexpipe-driver-recv", daemon=True).start()
        metrics = LiveMetrics(gear_id, time.monotonic())
        next_sample = time.monotonic() + metrics_period_s
        reconfig: dict | None = None
        reconfig_sent = False
        stopping = False
        sent = 0
        while True:
            # 1. commands
            try:
                while True:
                    cmd, arg = cmd_q.get_nowait()
                    if cmd == "add":
                        for req in arg:
                            try:
                                sched.add_request(req)
                                metrics.record_arrivals(1)
                            except (KVCapacityError, ValueError) as exc:
                                evt_q.put(("refused", req.request_id, str(exc)))
                    elif cmd == "reconfigure":
                        reconfig, reconfig_sent = arg, False
                        sched.admission_paused = True
                    elif cmd == "flush":
                        next_sample = 0.0
                    elif cmd == "stop":
                        stopping = True
                        sched.admission_paused = True
            except queue.Empty:
                pass
            # 2. dispatch
            while (mb := sched.schedule()) is not None:
                in_transport = True
                tp.send_message(layout.lane_rank(0, mb.lane), tp.BATCH, mb, tp.batch_input_ids(mb))
                in_transport = False
                sent += 1
                counters[F_STEPS] = sent
            drained = sched.num_running == 0 and sched.num_inflight_micro_batches == 0
            if reconfig is not None and drained and not reconfig_sent:
                in_transport = True
                for dst in first_ranks:
                    tp.send_message(dst, tp.RECONFIGURE, {**reconfig, "infos": []})
                in_transport = False
                reconfig_sent = True
                confirmations: dict = {}
            if stopping and drained and reconfig is None:  # queued requests are dropped on stop
                in_transport = True
                for dst in first_ranks:
                    tp.send_message(dst, tp.STOP, None)
                in_transport = False
                while True:
                    item = inbox.get(timeout=600)
                    if item[0] == tp.STOP:
                        break
                    if item[0] == "error":
                        raise item[1]
                evt_q.put(("stopped",))
                return
            # 3. results
            busy = sched.num_inflight_micro_batches > 0
            try:
                item = inbox.get(timeout=0.02 if busy or reconfig_sent else 0.005)
            except queue.Empty:
                item = None
            if item is not None:
                kind, meta = item
                if kind == "error":
                    in_transport = True
                    raise meta
                if kind == tp.RESULT:
                    mb_id, tokens = meta
                    metrics.record_tokens(len(tokens))
                    for out in sched.update_from_output(mb_id, tokens):
                        metrics.record_finished(out.ttft_s, out.tpot_s, out.e2e_s)
                        evt_q.put(("result", out))
                    counters[F_AUX] += 1
                elif kind == tp.RECONFIGURED:
                    for i in meta["infos"]:
                        confirmations[worker_slot(i)] = i
                    if len(confirmations) < layout.num_workers:
                        continue  # another last-stage replica has yet to confirm
                    layout = spec.layout(reconfig["num_blocks"])
                    sched.allocator.reset(layout.num_blocks, reconfig["block_size_tokens"], layout.num_lanes)
                    sched.micro_batch_size = reconfig.get("micro_batch_size", sched.micro_batch_size)
                    sched.max_inflight_micro_batches = reconfig.get("max_inflight_micro_batches",
                                                                    sched.max_inflight_micro_batches)
                    metrics.gear_id = reconfig.get("gear_id", metrics.gear_id)
                    evt_q.put(("reconfigured", list(confirmations.values())))
                    reconfig, reconfig_sent = None, False
                    sched.admission_paused = stopping
            elif not busy and not sched.has_unfinished():
                time.sleep(0.01)
            # 4. metrics
            now = time.monotonic()
            if now >= next_sample:
                stages = [StageCounters(  # a replicated stage: its steps summed, busy time averaged over replicas
                    int(sum(counters[layout.rank(s, k) * FIELDS + F_STEPS] for k in range(layout.replicas[s]))),
                    float(sum(counters[layout.rank(s, k) * FIELDS + F_BUSY_S] for k in range(layout.replicas[s]))
                          / layout.replicas[s])) for s in range(n)]
                evt_q.put(("metrics", metrics.sample(
                    now, queue_length=sched.num_waiting, running=sched.num_running,
                    kv_blocks_used=sched.allocator.num_used_blocks, kv_blocks_total=sched.allocator.num_blocks,
                    micro_batches_sent=sent, stages=stages)))
                next_sample = now + metrics_period_s
    except BaseException as exc:  # noqa: BLE001
        evt_q.put(("error", "driver", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}", in_transport))
        raise SystemExit(1) from None
    finally:
        from flexpipe_dag.runtime.worker import _destroy

        _destroy()
