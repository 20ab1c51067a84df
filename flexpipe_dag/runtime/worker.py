"""A stage worker process: loads one stage's layers and KV pool, then serves micro-batches forever.

Ranks: the driver is rank 0, worker ``w`` is rank ``w + 1`` and serves one replica of one stage
(stage ``s`` is worker ``s`` when no stage is replicated; :mod:`~flexpipe_dag.runtime.lanes`). A
worker receives from the ranks before it on its lanes (the driver for stage 0) and sends each
micro-batch to the next stage's replica of that micro-batch's lane (the last stage sends sampled
tokens back to the driver). Every link carries messages in FIFO order and the driver receives on
its own thread, so the ring cannot deadlock.

Control messages travel down the same lanes: ``RECONFIGURE`` makes every worker load a new layer
range and rebuild its KV pool in place (no process restart), ``STOP`` ends the loop; a worker fed
by several replicas acts once every one of them has passed the message on.

Shared counters (a ``multiprocessing`` double array, one row of
:data:`~flexpipe_dag.runtime.messages.COUNTER_SLOTS` per rank, slots
:class:`~flexpipe_dag.runtime.messages.WorkerCounter`) let the parent's watchdog see progress
without any message: steps done, busy seconds, the clock reading when the current step started
(0 when idle). Messages and events are the typed ones of :mod:`~flexpipe_dag.runtime.messages`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from flexpipe_dag.runtime.lifeline import follow_parent
from flexpipe_dag.runtime.messages import (
    MessageKind,
    ProcessFailed,
    StageInfo,
    StageReady,
    StageReload,
    StepResult,
    WorkerCounter,
    counter_index,
)

if TYPE_CHECKING:
    from flexpipe_dag.runtime.decode_graphs import DecodeGraphs
    from flexpipe_dag.runtime.kv_cache import PagedKVPool
    from flexpipe_dag.runtime.lanes import LaneLayout
    from flexpipe_dag.runtime.stage import StageModule


@dataclass
class WorkerSpec:
    """Everything a stage worker needs (picklable; sent to spawned processes; JSON through the
    control store to workers on other hosts, :func:`~flexpipe_dag.runtime.messages.to_json`).

    ``ranges[s]`` is stage ``s``'s ``[layer_start, layer_end)``; ``num_blocks`` the KV pool's blocks
    of ``block_size_tokens`` tokens each; ``device`` is ``"cpu"`` or a CUDA device string
    (``"cuda"`` means ``cuda:<stage>``).
    """

    checkpoint_path: str
    checkpoint_name: str
    ranges: list[tuple[int, int]]
    num_blocks: int
    block_size_tokens: int
    dtype: str = "auto"  # resolved by each worker on its device (model_loader.resolve_dtype)
    device: str = "cpu"
    backend: str = "gloo"
    #: ``HOST:PORT`` of the head's control store (:mod:`~flexpipe_dag.runtime.control_store`); every
    #: rank's process-group rendezvous goes through it
    control_address: str | None = None
    #: the run secret (:mod:`~flexpipe_dag.runtime.control_auth`): in the spawn arguments of local
    #: children, never in the spec the head publishes (remote workers set their own)
    control_secret: str = ""
    #: every rank on this host: the backend's data connections stay on the loopback interface too
    loopback_only: bool = False
    threads_per_rank: int = 1
    fault: dict = field(default_factory=dict)  # test hook: {"stage": s, "raise_after_steps": n}
    #: replicas per stage (None: one each); worker w serves layout().locate(w)
    replicas: list[int] | None = None
    #: :attr:`~flexpipe_dag.runtime.model_loader.Checkpoint.fingerprint` of the head's model (remote workers check it)
    checkpoint_fingerprint: str = ""
    #: hand-offs to the next stage that may wait in the background sender while this stage computes
    #: the next micro-batch (:class:`~flexpipe_dag.runtime.transport.BackgroundSender`); 0 sends
    #: each one before receiving the next
    max_pending_sends: int = 2
    #: CUDA graphs for decode steps (:data:`~flexpipe_dag.runtime.graph_modes.DECODE_GRAPH_MODES`)
    decode_graphs: str = "auto"

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def stage_replicas(self) -> tuple[int, ...]:
        """Replicas per stage (one each when ``replicas`` is unset)."""
        return tuple(self.replicas or [1] * self.num_stages)

    def layout(self, num_blocks: int | None = None) -> LaneLayout:
        """The :class:`~flexpipe_dag.runtime.lanes.LaneLayout` (ranks, lanes, KV split) of this spec."""
        from flexpipe_dag.runtime.lanes import LaneLayout

        return LaneLayout(self.stage_replicas, num_blocks or self.num_blocks)

    @property
    def num_workers(self) -> int:
        return sum(self.stage_replicas)

    @property
    def world_size(self) -> int:
        return self.num_workers + 1


#: ``sys.setswitchinterval`` of every rank (Python's default is 0.005 s), see :func:`setup_process`.
GIL_SWITCH_INTERVAL_S = 0.0002


def setup_process(spec: WorkerSpec, rank: int) -> None:
    """Thread limits and ``torch.distributed`` init for one rank (long timeout: the parent's watchdog
    decides when a step hangs, an idle pipeline must not time out). The rendezvous goes through the
    head's authenticated control store (``spec.control_address``, keys ``pg/...``).

    Raises:
        ValueError: the spec names no control store.
    """
    os.environ["OMP_NUM_THREADS"] = str(spec.threads_per_rank)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads_per_rank)
    # a rank's helper threads (the background sender, the driver's receiver) each need the GIL for a
    # moment per message while the main thread computes; Python's default 5 ms switch interval made
    # every hand-off wait up to that long per message part
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    from flexpipe_dag.runtime.rendezvous import keep_backend_on_loopback, parse_address, process_group_store

    if spec.loopback_only:
        keep_backend_on_loopback()
    if not spec.control_address:
        raise ValueError("WorkerSpec.control_address: expected the head's control store HOST:PORT")

    host, port = parse_address(spec.control_address, "control_address")
    store = process_group_store(host, port, 300.0, spec.control_secret)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size,
                            timeout=timedelta(days=1))


def stage_device(spec: WorkerSpec, worker: int) -> str:
    """Worker ``worker``'s torch device: ``cuda:<worker mod GPU count>`` for ``"cuda"`` (worker =
    stage without replicas), else ``spec.device``."""
    if spec.device == "cuda":
        import torch

        return f"cuda:{worker % max(1, torch.cuda.device_count())}"
    return spec.device


def link_device(spec: WorkerSpec, device: str, peer_rank: int) -> str:
    """Where a stage's messages to / from ``peer_rank`` live: the stage's GPU between stages under
    NCCL, host memory on links to the driver (rank 0) under the default ``cpu:gloo,cuda:nccl``
    backend, so the driver never takes a GPU (NCCL refuses two ranks of one communicator on one
    device) and only activations cross NCCL."""
    if "nccl" not in spec.backend or peer_rank == 0:
        return "cpu"
    return device


class StageRunner:
    """One stage replica's module and KV pool, rebuilt on reconfiguration."""

    def __init__(self, spec: WorkerSpec, stage: int, replica: int = 0):
        self.spec, self.stage, self.replica = spec, stage, replica
        self.worker = spec.layout().rank(stage, replica) - 1
        self.module: StageModule | None = None
        self.pool: PagedKVPool | None = None
        #: decode steps at padded static shapes, replayed as CUDA graphs (None: not on this device / off)
        self.graphs: DecodeGraphs | None = None
        #: the stage's observation ring (set by :func:`worker_main` once its recorder exists)
        self.observations_path: str | None = None
        self.load(spec.ranges, spec.num_blocks, spec.block_size_tokens, spec.checkpoint_path)

    def load(self, ranges: Sequence[tuple[int, int]], num_blocks: int, block_size_tokens: int,
             checkpoint_path: str) -> StageInfo:
        """Load this stage's layers of ``ranges`` and a pool for its lanes' share of ``num_blocks``."""
        import gc

        from flexpipe_dag.runtime.decode_graphs import make_decode_graphs
        from flexpipe_dag.runtime.model_loader import Checkpoint, load_stage_module, resolve_dtype

        self.module = self.pool = self.graphs = None
        gc.collect()
        a, b = ranges[self.stage]
        n = len(ranges)
        ckpt = Checkpoint(path=Path(checkpoint_path), name=self.spec.checkpoint_name)
        device = stage_device(self.spec, self.worker)
        if device.startswith("cuda"):  # this stage's GPU current: CUDA graphs capture on the current device
            import torch

            torch.cuda.set_device(device)
        module = load_stage_module(ckpt, a, b, first=self.stage == 0, last=self.stage == n - 1,
                                   dtype=resolve_dtype(self.spec.dtype, device))
        self.module = module = module.to(device)
        self.layout = self.spec.layout(num_blocks)
        self.pool = module.new_kv_pool(self.layout.replica_blocks(self.stage), block_size_tokens)
        self.graphs = make_decode_graphs(self.spec.decode_graphs, module, self.pool)
        self.ranges: list[tuple[int, int]] = list(ranges)
        return runner_info(self)

    def loaded(self) -> tuple[StageModule, PagedKVPool]:
        """The module and KV pool of the last :meth:`load` (both set unless that load raised)."""
        if self.module is None or self.pool is None:
            raise RuntimeError(f"stage {self.stage} replica {self.replica}: no layers loaded")
        return self.module, self.pool

    def local_batch(self, batch):
        """``batch`` with block tables in this replica's pool (a copy when lanes share the stage)."""
        layout = self.layout
        if layout.num_lanes == 1:
            return batch
        import dataclasses

        seqs = [dataclasses.replace(s, block_table=[layout.local_block(self.stage, b) for b in s.block_table])
                for s in batch.seqs]
        return dataclasses.replace(batch, seqs=seqs)


def worker_main(worker: int, spec: WorkerSpec, events, counters) -> None:
    """Entry point of worker ``worker`` (rank ``worker + 1``; stage and replica from the spec's lane
    layout). Reports :class:`~flexpipe_dag.runtime.messages.StageReady` and, on failure,
    :class:`~flexpipe_dag.runtime.messages.ProcessFailed` on ``events``, then exits non-zero."""
    follow_parent()  # leave with the head, however it ends; Ctrl-C is the head's to handle
    rank = worker + 1
    in_transport = False
    recorder = None
    try:
        setup_process(spec, rank)
        import torch

        from flexpipe_dag.runtime import transport as tp
        from flexpipe_dag.runtime.sampling import sample_tokens

        stage, replica = spec.layout().locate(worker)
        runner = StageRunner(spec, stage, replica)
        from flexpipe_dag.runtime.observations import StepRecorder

        recorder = StepRecorder(stage)  # per-step observations for calibration (a memory-mapped ring)
        runner.observations_path = recorder.path
        events.put(StageReady(worker, runner_info(runner)))
        device = stage_device(spec, worker)
        layout = runner.layout
        upstream = layout.upstream(stage, replica)
        downstream = layout.downstream(stage, replica)
        last = stage == spec.num_stages - 1
        recv_device = link_device(spec, device, upstream[0])
        steps_slot = counter_index(rank, WorkerCounter.STEPS)
        busy_slot = counter_index(rank, WorkerCounter.BUSY_S)
        started_slot = counter_index(rank, WorkerCounter.STEP_STARTED)
        steps = 0
        control: dict[MessageKind, list] = {}  # STOP / RECONFIGURE copies received, until every upstream sent one

        def handed_on(tag, send_ms: float) -> None:  # in the sender thread, once a micro-batch is delivered
            step, row, nbytes = tag
            if row is not None:
                recorder.set_send_at(row, send_ms, nbytes)
            # counted only once handed on: a stage stopped mid-send still holds the micro-batch, and
            # the watchdog's stall finder must name it, not the stage waiting for it
            counters[steps_slot] = step

        # one upstream: its messages; several replicas feed this one: whichever is ready
        inbox = tp.Inbox(upstream[0] if len(upstream) == 1 else None, recv_device)
        sender = tp.BackgroundSender(spec.max_pending_sends, handed_on) if spec.max_pending_sends > 0 else None

        def hand_on(dst: int, kind, meta, tensor=None, device="cpu", tag=None) -> None:
            if sender is not None:
                sender.send(dst, kind, meta, tensor, device=device, tag=tag)
                return
            transfer_ms = tp.send_framed(dst, tp.frame(kind, meta, tensor, device))
            if tag is not None:
                handed_on(tag, transfer_ms)

        def flush() -> None:
            if sender is not None:
                sender.flush()
        while True:
            in_transport = True
            _src, kind, meta, x = inbox.recv()
            in_transport = False
            if kind in (MessageKind.STOP, MessageKind.RECONFIGURE):
                control.setdefault(kind, []).append(meta)
                if len(control[kind]) < len(upstream):
                    continue  # wait for the same order along every lane
                copies = control.pop(kind)
                if kind == MessageKind.STOP:
                    in_transport = True
                    flush()
                    for dst in downstream:
                        tp.send_message(dst, MessageKind.STOP, None)
                    break
                cmd = copies[0].command
                in_transport = True
                flush()  # every micro-batch of the old layout is handed on before the stage reloads
                in_transport = False
                info = runner.load(cmd.ranges, cmd.num_blocks, cmd.block_size_tokens, spec.checkpoint_path)
                infos = {i.slot: i for c in copies for i in c.infos}
                infos[info.slot] = info
                in_transport = True
                for dst in downstream:
                    tp.send_message(dst, MessageKind.RECONFIGURED if last else MessageKind.RECONFIGURE,
                                    StageReload(cmd, tuple(infos.values())))
                layout = runner.layout
                continue
            if kind != MessageKind.BATCH:
                raise tp.TransportError(f"stage {stage}: unexpected message kind {kind.name}")
            t0 = time.monotonic()
            counters[started_slot] = t0
            if spec.fault.get("stage") == stage and steps >= spec.fault.get("raise_after_steps", 1 << 60):
                raise RuntimeError(f"injected fault after {steps} steps")
            module, pool = runner.loaded()
            out = module(runner.local_batch(meta), x, pool, runner.graphs)
            next_rank = layout.lane_rank(stage + 1, meta.lane)
            if last:
                tokens = sample_tokens(out, meta.seqs)
                payload = (MessageKind.RESULT, StepResult(meta.mb_id, tuple(int(t) for t in tokens)), None)
            else:
                payload = (MessageKind.BATCH, meta, out)
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            steps += 1
            t1 = time.monotonic()
            counters[busy_slot] += t1 - t0
            counters[started_slot] = 0.0
            layer_start, layer_end = runner.ranges[stage]
            recorder.begin(meta.mb_id, meta.seqs, layer_start, layer_end, (t1 - t0) * 1e3, t1)
            row = recorder.commit()
            in_transport = True
            hand_on(next_rank, payload[0], payload[1], payload[2], device=link_device(spec, device, next_rank),
                    tag=(steps, None if last else row, 0 if last else out.numel() * out.element_size()))
    except BaseException as exc:  # report, then die: the parent names this stage
        events.put(ProcessFailed(worker, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}", in_transport))
        raise SystemExit(1) from None
    finally:
        if recorder is not None:
            recorder.close()
        _destroy()


def runner_info(runner: StageRunner) -> StageInfo:
    """The :class:`~flexpipe_dag.runtime.messages.StageInfo` of a loaded :class:`StageRunner`."""
    a, b = runner.ranges[runner.stage]
    module, pool = runner.loaded()
    return StageInfo(stage_index=runner.stage, replica_index=runner.replica, layer_start=int(a), layer_end=int(b),
                     param_bytes=int(module.param_bytes()), kv_pool_bytes=int(pool.nbytes),
                     kv_capacity_tokens=int(pool.capacity_tokens), pid=os.getpid(), host=socket.gethostname(),
                     observations_path=runner.observations_path)


def _destroy() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
