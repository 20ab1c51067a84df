"""The multi-process pipeline, seen from the caller: start, serve, watch, reconfigure, stop.

:class:`PipelineRuntime` starts (``torch.multiprocessing``, forkserver or spawn context) one driver process
(rank 0: scheduler, dispatch, metrics; :mod:`~flexpipe_dag.runtime.driver`) and one worker per
stage (ranks 1..n; :mod:`~flexpipe_dag.runtime.worker`), joined by ``torch.distributed`` (gloo on
CPU, NCCL on GPU). The caller never joins the process group, so a failed run cannot poison the
caller's process and a new pipeline can start in it right away.

The caller thread is the watchdog: it sees every process's exit code, the error reports on the
event queue, and the shared step counters. A stage that dies, raises, or sits in one step (or
holds the oldest in-flight micro-batch) longer than ``step_timeout_s`` fails the run with
:class:`StageFailedError` naming the stage; results finished before that were already delivered
to ``on_result`` and are kept on the error.

One host (default): the driver and stage workers are children of the caller (their event queue and
shared step counters are ``multiprocessing`` objects); they rendezvous through an authenticated
control store of the run's own (:mod:`~flexpipe_dag.runtime.control_store`) bound to 127.0.0.1 on a
port the kernel picks, the run secret in their spawn arguments. Several hosts (``RuntimeOptions.control_address``):
the caller spawns only the driver and serves a control store that stage workers started on other
hosts join (:mod:`~flexpipe_dag.runtime.remote`); their reports and step counters arrive through it
into the same queue and counter array, so everything below works unchanged. ``deploy/MULTIHOST.md``
has the commands.

A stage with ``replicas`` > 1 runs one worker per replica (device); micro-batches are routed along
lanes so each replica keeps the KV cache of its own sequences (:mod:`~flexpipe_dag.runtime.lanes`).
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from flexpipe_dag.core.dtypes import compute_dtype
from flexpipe_dag.core.errors import FlexPipeError, InfeasibleError, InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.host import host_memory_bytes, process_stopped
from flexpipe_dag.core.metrics import SAMPLE_PERIOD_S, MetricSample
from flexpipe_dag.runtime.control_auth import new_secret
from flexpipe_dag.runtime.graph_modes import DECODE_GRAPH_MODES
from flexpipe_dag.runtime.messages import (
    COUNTER_SLOTS,
    AbortRequests,
    AddRequests,
    DriverCounter,
    FlushMetrics,
    MetricsSampled,
    ProcessFailed,
    Reconfigure,
    Reconfigured,
    RequestFinished,
    RequestRefused,
    SchedulerConfig,
    StageInfo,
    StageReady,
    Stopped,
    StopPipeline,
    TokensGenerated,
    WorkerCounter,
    counter_index,
    worker_slot,
)
from flexpipe_dag.runtime.model_loader import Checkpoint, memory_dtype, resolve_checkpoint, stage_param_bytes
from flexpipe_dag.runtime.remote import SILENT_AT_FAILURE_S
from flexpipe_dag.runtime.scheduler import Request, RequestOutput
from flexpipe_dag.runtime.worker import WorkerSpec

if TYPE_CHECKING:
    from flexpipe_dag.runtime.control_store import ControlStoreServer
    from flexpipe_dag.runtime.ray_placement import RayPlacement, StageWorkers, WorkerPlacement
    from flexpipe_dag.runtime.remote import ControlServer

#: Default backend on GPUs: NCCL carries activations between stages, gloo the driver's small messages.
CUDA_BACKEND = "cpu:gloo,cuda:nccl"
#: KV capacity used when the gear leaves ``kv_capacity_tokens`` at 0.
DEFAULT_KV_CAPACITY_TOKENS = 8192
#: Metric samples a runtime keeps (:attr:`PipelineRuntime.metric_samples`): about 5.5 hours of 2-s samples;
#: a serving lane samples for as long as it lives, idle or not.
METRIC_SAMPLES_KEPT = 10_000
#: Refusals, and truncations, a runtime remembers outside :meth:`PipelineRuntime.generate` (whose own are all
#: kept for its report): a serving lane refuses for as long as it lives; :meth:`PipelineRuntime.refusals_since`
#: hands each out once as it comes.
REFUSALS_KEPT = 10_000

#: An entry of a refusal / truncation table (:meth:`PipelineRuntime._remember`).
_Entry = TypeVar("_Entry")


class StageFailedError(FlexPipeError):
    """A pipeline stage (or the driver) crashed, raised, or hung; the run is over.

    Attributes:
        stage: the failed stage's index, or ``"driver"``.
        reason: what happened (exit code, exception, or watchdog finding).
        finished: outputs delivered before the failure (kept, not lost): those of the failed
            :meth:`PipelineRuntime.generate` call, and any no ``on_result`` callback took (one that did has them).
        replica: which replica of a replicated stage, else ``None``.
    """

    def __init__(self, stage: int | str, reason: str, finished: list[RequestOutput] | None = None,
                 replica: int | None = None):
        self.stage, self.reason, self.finished, self.replica = stage, reason, list(finished or []), replica
        name = f"stage {stage}" if isinstance(stage, int) else str(stage)
        if replica is not None:
            name += f" replica {replica}"
        super().__init__(f"{name} failed: {reason.strip().splitlines()[0] if reason.strip() else reason}")


@dataclass
class RuntimeOptions:
    """How to run a gear on this host.

    ``dtype``: compute dtype of weights, activations and the KV pool: ``fp32``, ``bf16``, ``fp16``, or
    ``auto`` (the default: fp32 on a CPU, bf16 on a GPU that has it, else fp16; each stage worker
    resolves it on its own device, :func:`~flexpipe_dag.runtime.model_loader.resolve_dtype`).
    ``device``: ``"cpu"`` or ``"cuda"`` (stage ``s`` on ``cuda:<s mod GPU count>``; remote stage
    workers on their ``cuda:<local rank>``); ``backend`` defaults to gloo on CPU and on CUDA to
    :func:`cuda_backend` (NCCL between stages, gloo to the driver; gloo alone when stages share a
    GPU). ``step_timeout_s``: watchdog limit for one step. ``device_memory_bytes``:
    per device id, for the fit check (default: this host's physical memory shared by the stages).
    ``start_method``: ``"forkserver"`` (default: stage processes fork from a server that imported
    torch and the stage code once per caller process, so a pipeline starts in about a second after
    the first) or ``"spawn"`` (every process imports everything itself, ~5 s of CPU each).
    Forkserver children inherit the environment the server started with (at this process's first
    pipeline), not the caller's current one: use ``"spawn"`` when a pipeline needs its own
    environment variables (e.g. ``CUDA_VISIBLE_DEVICES``).
    ``max_context_tokens``: the longest prompt + ``max_new_tokens`` a request may have (default:
    the checkpoint's ``max_position_embeddings``; at most it, like vLLM's ``max_model_len``); a
    longer request is refused with a per-request reason (:attr:`PipelineRuntime.refused`), or with
    ``truncate_context`` served with its prompt cut from the left, the most recent tokens kept
    (:func:`flexpipe_dag.workload.context.fit_to_context`; listed in :attr:`PipelineRuntime.truncated`).
    As vLLM's ``truncate_prompt_tokens``, truncation cuts only the prompt: a request whose
    ``max_new_tokens`` alone leave no room for one prompt token (``max_new_tokens >= max_context_tokens``)
    is refused with its numbers, never served with its output capped.
    ``control_address``: ``"HOST:PORT"`` to serve stage workers started elsewhere (other hosts:
    ``flexpipe worker --head HOST:PORT --stage S``, or ``flexpipe run --launched`` under a
    launcher; :mod:`~flexpipe_dag.runtime.remote`); only the driver is spawned here and the head
    listens on ``PORT`` (``HOST`` names this host in messages); ``PORT`` 0 picks a free port, which
    :meth:`PipelineRuntime.listen` returns before the workers are started. ``None`` (default):
    every stage is a child of this process. ``heartbeat_timeout_s``: a remote stage silent this
    long is lost. ``secret``: the run secret every process must prove to the control store
    (:mod:`~flexpipe_dag.runtime.control_auth`; ``None``: a fresh one, :attr:`PipelineRuntime.secret`,
    handed to local children in their spawn arguments; remote workers need it from a file or the
    environment). Either way the control store binds exactly ``HOST`` (127.0.0.1 for a one-host run,
    on a port the kernel picks). ``kv_capacity_knob``: what a request's KV refusal tells the user to
    raise (``--kv-capacity-tokens`` for ``flexpipe run``, ``kv_pool_tokens_max`` for ``batch_inference``).
    ``stream_tokens``: :meth:`PipelineRuntime.wait` hands every sampled token to its ``on_tokens``
    as the step that sampled it ends (a streaming front end); off, only finished requests come back.
    ``max_tokens_per_micro_batch``: the token budget of one micro-batch (prompt tokens + one per
    decode); with ``chunked_prefill`` prompts are cut into chunks that fill it, so every micro-batch
    costs about the same (:class:`~flexpipe_dag.runtime.scheduler.Scheduler`).
    ``max_pending_sends``: micro-batches a stage may have handed to its background sender and not
    yet delivered while it computes the next (hand-offs overlapped with compute); 0 sends each
    before receiving the next.
    ``decode_graphs``: ``auto`` (default: a stage on a CUDA device replays a CUDA graph per padded
    decode shape, :mod:`~flexpipe_dag.runtime.decode_graphs`; a CPU stage runs as before), ``off``
    (no graphs), or ``eager`` (the padded static-shape decode path without capture, on any device).
    ``placement``: a :class:`~flexpipe_dag.runtime.ray_placement.RayPlacement` to have Ray start
    every stage worker on the host its device belongs to (one actor per worker, requesting the
    host's ``flexpipe_host_<node_id>`` resource), instead of spawning them here or waiting for
    workers started by hand; the head serves them as remote workers (``control_address``, default
    ``<the placement's head host>:0``). A gear shift's new pipeline inherits it.
    """

    dtype: str = "auto"
    device: str = "cpu"
    backend: str | None = None
    step_timeout_s: float = 60.0
    start_timeout_s: float = 300.0
    metrics_period_s: float = SAMPLE_PERIOD_S
    max_tokens_per_micro_batch: int = 2048
    chunked_prefill: bool = False
    threads_per_rank: int = 1
    device_memory_bytes: dict[str, int] | None = None
    fault: dict = field(default_factory=dict)
    start_method: str = "forkserver"
    control_address: str | None = None
    heartbeat_timeout_s: float = 15.0
    max_context_tokens: int | None = None
    truncate_context: bool = False
    secret: str | None = None
    kv_capacity_knob: str = "the gear's kv_capacity_tokens"
    stream_tokens: bool = False
    max_pending_sends: int = 2
    decode_graphs: str = "auto"
    placement: RayPlacement | None = None


#: Modules the forkserver imports once, so stage and driver processes fork with them loaded; the first makes the
#: forkserver ignore SIGTERM (a stop sent to the head's process group must not end it: module docstring).
FORKSERVER_PRELOAD = ["flexpipe_dag.runtime.forkserver_signals", "flexpipe_dag.runtime.stage",
                      "flexpipe_dag.runtime.worker", "flexpipe_dag.runtime.driver", "flexpipe_dag.runtime.live_metrics"]


def process_context(start_method: str):
    """A ``torch.multiprocessing`` context; the forkserver one preloads :data:`FORKSERVER_PRELOAD`.

    Raises:
        InputError: an unknown start method (``fork`` is refused: forking a caller that may hold
            threads or a CUDA context is unsafe).
    """
    import torch.multiprocessing as mp

    if start_method not in ("forkserver", "spawn"):
        raise InputError(None, "start_method", f"expected 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    return ctx


def cuda_backend(num_stages: int, gpus: int | None = None) -> str:
    """:data:`CUDA_BACKEND` when every stage has a GPU of its own on this host; otherwise (stages
    sharing a GPU, which NCCL refuses within one communicator) gloo, moving activations through
    host memory. ``gpus`` defaults to ``torch.cuda.device_count()``."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    return CUDA_BACKEND if gpus >= num_stages else "gloo"


def kv_num_blocks(gear: Gear) -> int:
    """KV blocks per stage for a gear (``kv_capacity_tokens`` or the default, in whole blocks)."""
    cap = gear.kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS
    return max(1, cap // gear.kv_block_size_tokens)


def stage_memory_bytes(gear: Gear, ckpt: Checkpoint, dtype: str = "fp32", device: str = "cpu") -> list[dict]:
    """Per stage: parameter bytes (from tensor headers), KV pool bytes and their sum, before launch
    (``dtype`` ``auto`` sized for ``device``: :func:`~flexpipe_dag.runtime.model_loader.memory_dtype`)."""
    from flexpipe_dag.runtime.kv_cache import kv_bytes_per_token

    if gear.num_layers != ckpt.num_layers:
        raise InputError("gear", "num_layers", f"gear covers {gear.num_layers} layers, model {ckpt.name!r} "
                         f"has {ckpt.num_layers}")
    cfg = ckpt.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads  # None: one per head (HF's default)
    nbytes = int(compute_dtype(memory_dtype(dtype, device)).bytes_per_element)
    tokens = kv_num_blocks(gear) * gear.kv_block_size_tokens
    n = gear.num_stages
    rows = []
    for i, st in enumerate(gear.stages):
        params = stage_param_bytes(ckpt, st.layer_start, st.layer_end, first=i == 0, last=i == n - 1,
                                   dtype_bytes=nbytes)
        if i == n - 1 and i == 0 and "lm_head.weight" not in ckpt.tensor_files:
            params -= ckpt.config.vocab_size * ckpt.config.hidden_size * nbytes  # tied head counted once
        kv = tokens * kv_bytes_per_token(st.num_layers, kv_heads, head_dim, nbytes)
        rows.append({"stage_index": i, "device_ids": list(st.device_ids), "param_bytes": params,
                     "kv_pool_bytes": kv, "total_bytes": params + kv})
    return rows


def check_gear_supported(gear: Gear) -> None:
    """Refuse, before launch, what the prefill-only scoring path cannot run: a stage with
    ``replicas`` > 1 (DeepSpeed's ``PipelineModule`` has one rank per stage). The generation
    runtime runs replicas (:mod:`~flexpipe_dag.runtime.lanes`).

    Raises:
        InfeasibleError: naming the first replicated stage and its devices.
    """
    for st in gear.stages:
        if st.replicas > 1:
            raise InfeasibleError(
                f"gear {gear.gear_id!r}: stage {st.stage_index} has {st.replicas} replicas "
                f"(devices {list(st.device_ids)}); scoring runs one rank per stage; "
                f"choose a gear without replicated stages")


def gear_lane_layout(gear: Gear):
    """The runtime's :class:`~flexpipe_dag.runtime.lanes.LaneLayout` for ``gear``.

    Raises:
        InfeasibleError: the KV pool has fewer blocks than a replica's lanes.
    """
    from flexpipe_dag.runtime.lanes import gear_layout

    try:
        return gear_layout(gear, kv_num_blocks(gear))
    except ValueError as exc:
        lanes = max(st.replicas for st in gear.stages)
        need = lanes * gear.kv_block_size_tokens
        raise InfeasibleError(f"gear {gear.gear_id!r}: {exc}; its KV pool of {kv_num_blocks(gear)} block(s) of "
                              f"{gear.kv_block_size_tokens} tokens needs at least one block per lane: raise "
                              f"kv_capacity_tokens (--kv-capacity-tokens) to >= {need} or more") from None


def check_gear_fits(gear: Gear, ckpt: Checkpoint, options: RuntimeOptions) -> list[dict]:
    """Refuse, before launch, a gear whose stages do not fit their devices.

    A device without a figure in ``options.device_memory_bytes`` (a CPU worker) gets an equal share of
    this host's memory: the host's bytes divided by the number of such stage workers, replicas included.

    Raises:
        InfeasibleError: naming the first stage whose weights + KV pool exceed its device memory.
    """
    rows = stage_memory_bytes(gear, ckpt, options.dtype, options.device)
    mem = options.device_memory_bytes
    # every stage worker (replicas each count) without a figure of its own shares this host's memory
    host_workers = sum(1 for st in gear.stages for dev in st.device_ids if not mem or dev not in mem)
    host_share = host_memory_bytes() // max(1, host_workers)
    for row in rows:
        for dev in row["device_ids"]:
            cap = mem.get(dev, host_share) if mem else host_share
            if row["total_bytes"] > cap:
                raise InfeasibleError(
                    f"stage {row['stage_index']} on device {dev!r} needs {row['total_bytes'] / 2**30:.2f} GiB "
                    f"(weights {row['param_bytes'] / 2**30:.2f} GiB + KV pool {row['kv_pool_bytes'] / 2**30:.2f} GiB) "
                    f"but the device has {cap / 2**30:.2f} GiB")
    return rows


class PipelineRuntime:
    """A gear served by real processes. Use as a context manager, or call :meth:`start` / :meth:`shutdown`.

    Args:
        gear: stages, micro-batch size, in-flight micro-batches, KV block size and capacity.
        model: a :class:`Checkpoint`, a source for :func:`resolve_checkpoint`, or ``None`` (SmolLM2).
        options: :class:`RuntimeOptions`.

    Raises (at :meth:`start`): InputError / InfeasibleError before anything launches (a stage that
    does not fit its device, or has replicas > 1); StageFailedError if a stage fails to load.
    """

    def __init__(self, gear: Gear, model: Checkpoint | str | os.PathLike | None = None,
                 options: RuntimeOptions | None = None):
        self.gear = gear
        self.ckpt = model if isinstance(model, Checkpoint) else resolve_checkpoint(model)
        self.options = options or RuntimeOptions()
        if self.options.decode_graphs not in DECODE_GRAPH_MODES:
            raise InputError(None, "decode_graphs", f"expected one of {', '.join(DECODE_GRAPH_MODES)}, "
                                                    f"got {self.options.decode_graphs!r}")
        #: per worker (stage order, replicas together): what it reported once loaded; empty before start
        self.worker_infos: list[StageInfo] = []
        self._procs: list = []  # [driver, stage 0, stage 1, ...]
        self._outstanding: set[str] = set()
        # outputs kept for generate()'s return and StageFailedError.finished; one a waiting call's on_result
        # took is not kept (a server's lane runs for days: its outputs live in its ledger, not here)
        self._finished: list[RequestOutput] = []
        self._keep_finished = False
        self._metrics: collections.deque[MetricSample] = collections.deque(maxlen=METRIC_SAMPLES_KEPT)
        # request id -> (its refusal's number, reason), in the order made (a repeated id moves to the end)
        self._refused: collections.OrderedDict[str, tuple[int, str]] = collections.OrderedDict()
        self._truncated: collections.OrderedDict[str, str] = collections.OrderedDict()  # request id -> how
        self._refusals_made = 0  # every refusal so far, forgotten ones included (refusals_since's cursor)
        self._refusal_lock = threading.RLock()  # refusals are noted by the caller's and the pump's threads
        self._stall_mark: tuple[tuple[float, float], float] | None = None  # ((sent, done), since when)
        self._on_result: Callable[[RequestOutput], None] | None = None
        self._started = False
        self._control: ControlServer | None = None  # when the stages are remote
        self._local_store: ControlStoreServer | None = None  # the rendezvous of a one-host run
        #: the run secret (RuntimeOptions.secret, or a fresh one)
        self.secret = self.options.secret or new_secret()
        self._abort_reason: str | None = None
        self._layout = gear_lane_layout(gear)
        self._placed: StageWorkers | None = None  # stage workers Ray started (options.placement)
        self._places: list[WorkerPlacement] | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def _spec(self) -> WorkerSpec:
        o = self.options
        backend = o.backend or "gloo"
        if o.device == "cuda" and (not o.backend or o.backend == "nccl"):  # remote stages: a GPU each
            backend = CUDA_BACKEND if self._control else cuda_backend(self._layout.num_workers)
        return WorkerSpec(checkpoint_path=str(self.ckpt.path), checkpoint_name=self.ckpt.name,
                          ranges=self.gear.layer_ranges(), num_blocks=kv_num_blocks(self.gear),
                          block_size_tokens=self.gear.kv_block_size_tokens, dtype=o.dtype, device=o.device,
                          backend=backend, control_address=self._store_address(),
                          control_secret=self.secret, loopback_only=self._control is None,
                          threads_per_rank=o.threads_per_rank, fault=dict(o.fault),
                          replicas=[st.replicas for st in self.gear.stages],
                          checkpoint_fingerprint=self.ckpt.fingerprint if self._control else "",
                          max_pending_sends=o.max_pending_sends, decode_graphs=o.decode_graphs)

    def _store_address(self) -> str:
        """``HOST:PORT`` of the control store the ranks rendezvous through: the remote head's, or a
        store of this run's own on 127.0.0.1 (the kernel picks the port: no free-port race)."""
        if self._control is not None:
            return self._control.local_address
        if self._local_store is None:
            from flexpipe_dag.runtime.control_store import ControlStoreServer

            self._local_store = ControlStoreServer("127.0.0.1", 0, self.secret)
        return f"127.0.0.1:{self._local_store.port}"

    @property
    def stage_info(self) -> list[dict]:
        """:attr:`worker_infos` as plain dicts (``stage_index``, ``replica_index``, ``layer_start``,
        ``layer_end``, ``param_bytes``, ``kv_pool_bytes``, ``kv_capacity_tokens``, ``pid``, ``host``,
        ``observations_path``), for reports and JSON; empty before :meth:`start`."""
        return [i.as_dict() for i in self.worker_infos]

    def start(self) -> list[dict]:
        """Check the fit, spawn the processes, wait until every stage has loaded; returns
        :attr:`stage_info` (``param_bytes``, ``kv_pool_bytes``, ``kv_capacity_tokens``, ``pid`` per worker)."""
        from flexpipe_dag.runtime.driver import driver_main
        from flexpipe_dag.runtime.worker import worker_main

        layout = self._layout
        if self.options.placement is not None:
            self._check_placement()
        if self.options.control_address or self.options.placement is not None:
            self.listen()
        else:
            check_gear_fits(self.gear, self.ckpt, self.options)  # remote hosts' memory is not known here
        spec = self._spec()
        ctx = process_context(self.options.start_method)
        self._events = ctx.Queue()
        self._cmds = ctx.Queue()
        self._counters = ctx.RawArray("d", COUNTER_SLOTS * spec.world_size)
        sched_cfg = SchedulerConfig(micro_batch_size=self.gear.micro_batch_size,
                                    max_inflight_micro_batches=self.gear.max_inflight_micro_batches,
                                    max_tokens_per_micro_batch=self.options.max_tokens_per_micro_batch,
                                    max_context_tokens=self.max_context_tokens,
                                    kv_capacity_knob=self.options.kv_capacity_knob,
                                    stream_tokens=self.options.stream_tokens,
                                    chunked_prefill=self.options.chunked_prefill)
        self._procs = [ctx.Process(target=driver_main, name="flexpipe-driver", daemon=True,
                                   args=(spec, self.gear.gear_id, sched_cfg, self._cmds, self._events,
                                         self._counters, self.options.metrics_period_s))]
        if self._control is None:
            self._procs += [ctx.Process(target=worker_main, name=f"flexpipe-worker-{w}", daemon=True,
                                        args=(w, spec, self._events, self._counters))
                            for w in range(spec.num_workers)]
        for p in self._procs:
            p.start()
        if self._control is not None:
            self._control.publish(spec)
            self._control.start(self._events, self._counters)
            self._procs += self._control.workers
        self._started = True
        if self._places is not None:
            try:
                self._start_placed(spec.device)
            except Exception as exc:  # the cluster went away between the check and the start
                self._fail("head", f"Ray could not start the stage workers: {type(exc).__name__}: {exc}")
        info: dict[int, StageInfo] = {}
        deadline = time.monotonic() + self.options.start_timeout_s
        while len(info) < spec.num_workers:
            if time.monotonic() > deadline:
                missing = sorted(set(range(spec.num_workers)) - set(info))
                why = f"did not load within {self.options.start_timeout_s:.0f} s"
                culprit = missing[0]
                control = self._control
                unclaimed = [w for w in missing if w not in control.claimed()] if control is not None else []
                if control is not None and unclaimed and self._placed is not None:
                    culprit = unclaimed[0]
                    why = (f"no worker joined within {self.options.start_timeout_s:.0f} s: its Ray actor on "
                           f"{self._placed.describe(culprit)} did not start or could not reach the head at "
                           f"{control.address} (`ray status` shows pending actors; is that resource taken?)")
                elif control is not None and unclaimed:  # the others wait for it in the rendezvous: name the absent one
                    culprit = unclaimed[0]
                    stage, replica = layout.locate(culprit)
                    which = f"--stage {stage}" + (f" --replica {replica}" if layout.replicas[stage] > 1 else "")
                    why = (f"no worker joined within {self.options.start_timeout_s:.0f} s; start one with "
                           f"`flexpipe worker --head {control.address} {which} --secret-file FILE` (FILE: a copy "
                           f"of the run secret this head named when it started)")
                self._fail(culprit, why)
            ev = self._next_event(0.2)
            if isinstance(ev, StageReady):
                info[ev.worker] = ev.info
        self.worker_infos = [info[w] for w in range(spec.num_workers)]  # per worker: stage order, replicas together
        return self.stage_info

    def listen(self) -> str:
        """With ``options.control_address``: serve the control store now (idempotent; :meth:`start`
        does it itself) and return the ``HOST:PORT`` workers should use, with the port actually
        bound: ``control_address`` ``"HOST:0"`` picks a free one, so a caller that starts the workers
        itself learns it here, before :meth:`start` waits for them.

        Raises:
            InputError: no ``control_address``, a bad one, or its port cannot be bound.
        """
        address = self.options.control_address
        if not address and self.options.placement is not None:
            address = f"{self._placement_head_host()}:0"
        if not address:
            raise InputError(None, "control_address", "listen() serves remote stage workers: set "
                                                      "RuntimeOptions.control_address = 'HOST:PORT'")
        if self._control is None:
            from flexpipe_dag.runtime.remote import ControlServer, parse_address

            host, port = parse_address(address, "control_address")
            self._control = ControlServer(port, self._layout.num_workers, self.options.heartbeat_timeout_s, host=host,
                                          secret=self.secret)
        return self._control.address

    # -- placement by Ray ------------------------------------------------------------------------
    def _check_placement(self) -> None:
        """Join the Ray cluster and check that every host of the gear has a node offering its resource."""
        from flexpipe_dag.runtime.ray_placement import check_hosts

        if self._places is None:
            assert self.options.placement is not None
            self._places = check_hosts(self.options.placement, self.gear)

    def _placement_head_host(self) -> str:
        """The interface the control store binds for Ray-placed workers (``RayPlacement.head_host``,
        its ``node_ip_address``, else the address Ray reports for this node)."""
        pl = self.options.placement
        assert pl is not None
        if pl.head_host or pl.node_ip_address:
            return str(pl.head_host or pl.node_ip_address)
        from flexpipe_dag.runtime.ray_placement import connect_ray

        return str(connect_ray(pl).util.get_node_ip_address())

    def _start_placed(self, device: str) -> None:
        """Start one Ray actor per stage worker on its host; each runs ``serve_stage`` against our store."""
        from flexpipe_dag.runtime.ray_placement import StageWorkers

        pl, control, places = self.options.placement, self._control, self._places
        assert pl is not None and control is not None and places is not None

        def on_failure(worker: int, reason: str) -> None:
            control.workers[worker].placement_failure = reason

        self._placed = StageWorkers(pl, places, control.address, self.secret, device,
                                    pl.model or str(self.ckpt.path), on_failure=on_failure)
        for w, st in enumerate(control.workers):
            st.placed_on = self._placed.describe(w)
        self._placed.start()

    @property
    def placement(self) -> list[dict]:
        """Where Ray placed each stage worker (``RuntimeOptions.placement``): ``worker``, ``stage``,
        ``replica``, ``device_id``, ``host``, ``resource``, ``ray_node_id``, ``pid``; empty otherwise."""
        if self._placed is None:
            return []
        locs = self._placed.locations()
        if self._control is not None:
            for w, st in enumerate(self._control.workers):
                st.placed_on = self._placed.describe(w)
        return locs

    @property
    def remote_stages(self) -> list:
        """Handles of stage workers on other hosts (:class:`~flexpipe_dag.runtime.remote.RemoteStage`),
        empty when every stage is a child of this process."""
        return list(self._control.workers) if self._control is not None else []

    def stage_pids(self) -> list[int]:
        """Process id of each stage worker, in stage order."""
        return [p.pid for p in self._procs[1:]]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain and stop every process (forcefully after ``timeout_s``)."""
        if not self._started:
            if self._control is not None:  # listening (listen()) but never started
                self._control.abort("the pipeline stopped before it started")
                self._control.close()
                self._control = None
            return
        self._started = False
        alive = all(p.is_alive() for p in self._procs)
        if alive:
            self._cmds.put(StopPipeline())
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    ev = self._events.get(timeout=0.2)
                except queue.Empty:
                    if not all(p.is_alive() for p in self._procs):
                        break
                    continue
                if isinstance(ev, Stopped):
                    break
        self._kill_all(grace_s=5.0 if alive else 0.5)

    def _kill_all(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self._placed is not None:  # the workers have left (or were lost): end their Ray actors
            self._placed.close(grace_s=min(grace_s, 2.0))
            self._placed = None
        if self._control is not None:
            self._control.abort("the pipeline stopped")
            self._control.close()
            self._control = None
        if self._local_store is not None:
            self._local_store.close()
            self._local_store = None

    def __enter__(self) -> PipelineRuntime:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Drain and stop (:meth:`shutdown`); when the block was interrupted (a ``BaseException``
        that is not an ``Exception``: ``KeyboardInterrupt``, ``SystemExit``, Dagster's
        ``DagsterExecutionInterruptedError`` when a run is terminated) kill every process at once
        instead: nobody is left to take the drained results."""
        if exc_type is not None and not issubclass(exc_type, Exception):
            self._started = False
            self._kill_all(grace_s=0.0)
            return
        self.shutdown()

    # -- serving ----------------------------------------------------------------------------------
    @property
    def longest_request_tokens(self) -> int:
        """Prompt + ``max_new_tokens`` of the longest request this pipeline serves: its context
        (:attr:`max_context_tokens`, when known) or, when smaller, what one lane of its KV pool holds (a
        request needs prompt + ``max_new_tokens`` - 1 KV tokens: :func:`~flexpipe_dag.core.kv.kv_tokens_needed`),
        as vLLM's ``max_model_len`` never exceeds its KV cache."""
        lane_tokens = self._layout.blocks_per_lane * self.gear.kv_block_size_tokens + 1
        context = self.max_context_tokens
        return lane_tokens if context is None else min(context, lane_tokens)

    @property
    def max_context_tokens(self) -> int | None:
        """Prompt + ``max_new_tokens`` a request may have: ``RuntimeOptions.max_context_tokens``, else the
        checkpoint's ``max_position_embeddings`` (``None``: not known, not checked).

        Raises:
            InputError: the option is below 2 or above the checkpoint's max context, naming both.
        """
        from flexpipe_dag.workload.context import check_max_context_tokens

        model_max = self.ckpt.max_context_tokens
        wanted = check_max_context_tokens(self.options.max_context_tokens, "RuntimeOptions")
        if wanted is None:
            return model_max
        if model_max is not None and wanted > model_max:
            raise InputError("RuntimeOptions", "max_context_tokens",
                             f"{wanted} tokens exceeds {self.ckpt.name}'s max context of {model_max} tokens "
                             f"(max_position_embeddings); expected 2..{model_max}")
        return wanted

    def _fit_context(self, reqs: list[Request]) -> list[Request]:
        """With ``truncate_context``: requests over the max context with the prompt cut to fit it (recorded in
        :attr:`truncated`); one whose ``max_new_tokens`` alone leave no room for a prompt token is refused
        (recorded in :attr:`refused`, not submitted): truncation cuts the prompt only, as vLLM's."""
        import dataclasses

        from flexpipe_dag.runtime.scheduler import CONTEXT_REFUSAL
        from flexpipe_dag.workload.context import fit_to_context

        limit = self.max_context_tokens if self.options.truncate_context else None
        if limit is None:
            return reqs
        out = []
        for r in reqs:
            n = len(r.prompt_token_ids)
            if r.max_new_tokens >= limit:
                self._remember_refusal(r.request_id, (
                    f"request {r.request_id!r}: prompt {n} + max_new_tokens {r.max_new_tokens} = "
                    f"{n + r.max_new_tokens} tokens {CONTEXT_REFUSAL} of {limit} tokens, and max_new_tokens alone "
                    f"leaves no room for one prompt token (truncation cuts only the prompt); expected max_new_tokens "
                    f"at most {limit - 1}"))
                continue
            keep, _ = fit_to_context(n, r.max_new_tokens, limit)  # max_new_tokens < limit: only the prompt is cut
            if keep != n:
                self._remember(self._truncated, r.request_id,
                               f"prompt {n} -> {keep} tokens (the last ones kept); max context {limit} tokens")
                r = dataclasses.replace(r, prompt_token_ids=list(r.prompt_token_ids[n - keep:]))
            out.append(r)
        return out

    def submit(self, requests: Iterable[Request]) -> list[str]:
        """Queue requests (non-blocking); returns their ids. One over the max context is refused by the
        scheduler (:attr:`refused`), or with ``truncate_context`` cut to it first (:attr:`truncated`)."""
        reqs = self._fit_context(list(requests))
        ids = [r.request_id for r in reqs]
        self._outstanding.update(ids)
        self._cmds.put(AddRequests(tuple(reqs)))
        return ids

    def cancel(self, request_ids: Iterable[str]) -> None:
        """End submitted requests nobody waits for any more (non-blocking; any thread): the driver frees
        their KV blocks (:meth:`~flexpipe_dag.runtime.scheduler.Scheduler.abort`) and each comes back, through
        the waiting call's ``on_result``, as an output with ``finish_reason`` ``"abort"`` and the tokens it
        had. One that finished or was refused first comes back as that instead. Ids never submitted are ignored."""
        ids = tuple(request_ids)
        if ids:
            self._cmds.put(AbortRequests(ids))

    def generate(self, requests: Iterable[Request], on_result: Callable[[RequestOutput], None] | None = None,
                 on_metrics: Callable[[MetricSample], None] | None = None) -> list[RequestOutput]:
        """Serve ``requests`` and block until all finished; results in finishing order.

        ``on_result`` is called in this thread as each request finishes (so a sink keeps them even if
        the run later fails); ``on_metrics`` every ``metrics_period_s``.

        Raises:
            StageFailedError: a stage crashed, raised or hung (its ``finished`` holds the delivered outputs).
        """
        start = len(self._finished)
        self._keep_finished = True
        try:
            self.submit(requests)
            self.wait(on_result, on_metrics)
        finally:
            self._keep_finished = False
        return self._finished[start:]

    def wait(self, on_result=None, on_metrics=None,
             on_tokens: Callable[[tuple[tuple[str, int, int], ...]], None] | None = None) -> None:
        """Block until every submitted request finished or was refused (see :meth:`generate`).

        With ``RuntimeOptions.stream_tokens``, ``on_tokens`` gets each step's ``(request_id, index,
        token_id)`` triples as they come, before the ``on_result`` of a request they finish. Tokens that
        arrive while no ``wait`` runs (a reconfiguration, a metrics flush) are not replayed: the
        finished request carries all its tokens.
        """
        self._on_result = on_result
        while self._outstanding:
            self._handle(self._next_event(0.1), on_metrics, on_tokens)

    def poll(self, timeout_s: float, on_result=None, on_metrics=None,
             on_tokens: Callable[[tuple[tuple[str, int, int], ...]], None] | None = None) -> int:
        """Handle the events that are waiting, or the first one to come within ``timeout_s`` seconds, whether or
        not a request is outstanding: an idle pipeline's metric samples (one per ``metrics_period_s``, zero
        load), and the health checks of :meth:`wait` (a stage that died while idle is found now, not at the
        next request). Callbacks as :meth:`wait`'s. Returns how many events were handled.

        Raises:
            StageFailedError: as :meth:`generate`.
        """
        self._on_result = on_result
        handled, wait_s = 0, timeout_s
        while True:
            ev = self._next_event(wait_s)
            if ev is None:
                return handled
            self._handle(ev, on_metrics, on_tokens)
            handled, wait_s = handled + 1, 0.0

    def _handle(self, ev, on_metrics, on_tokens) -> None:
        """One event of the processes (None: nothing came) to the waiting call's callbacks."""
        if isinstance(ev, TokensGenerated):
            if on_tokens is not None:
                on_tokens(ev.tokens)
        elif isinstance(ev, RequestFinished):
            self._deliver(ev.output)
        elif isinstance(ev, MetricsSampled):
            self._record(ev.sample, on_metrics)
        elif isinstance(ev, RequestRefused):
            self._note_refusal(ev)

    def _note_refusal(self, ev: RequestRefused) -> None:
        """A request the scheduler will not serve: no longer outstanding, its reason kept (:attr:`refused`)."""
        self._outstanding.discard(ev.request_id)
        self._remember_refusal(ev.request_id, ev.reason)

    def _remember_refusal(self, request_id: str, reason: str) -> None:
        with self._refusal_lock:
            self._refusals_made += 1
            self._remember(self._refused, request_id, (self._refusals_made, reason))

    def _remember(self, table: collections.OrderedDict[str, _Entry], request_id: str, entry: _Entry) -> None:
        """Note ``request_id``'s ``entry`` in ``table`` as its newest; outside :meth:`generate`, the oldest beyond
        :data:`REFUSALS_KEPT` are forgotten."""
        with self._refusal_lock:
            table.pop(request_id, None)
            table[request_id] = entry
            while not self._keep_finished and len(table) > REFUSALS_KEPT:
                table.popitem(last=False)

    def refusals_since(self, cursor: int) -> tuple[dict[str, str], int]:
        """The refusals made after the first ``cursor`` (request id -> reason, oldest first), and the cursor to
        pass next time (start with 0). A caller that polls at least once per :data:`REFUSALS_KEPT` refusals
        sees each once (an id refused again, once more); older ones are forgotten."""
        with self._refusal_lock:
            newest = list(itertools.takewhile(lambda item: item[1][0] > cursor, reversed(self._refused.items())))
            return {rid: why for rid, (_, why) in reversed(newest)}, self._refusals_made

    def flush_metrics(self, on_metrics: Callable[[MetricSample], None] | None = None,
                      timeout_s: float = 10.0) -> MetricSample | None:
        """Ask the driver for a metrics sample now (the partial window since the last one), e.g. at
        the end of a batch job shorter than the sample period; returns it (``None`` on timeout).

        Raises:
            StageFailedError: as :meth:`generate`.
        """
        self._cmds.put(FlushMetrics())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ev = self._next_event(0.1)
            if ev is None:
                continue
            if isinstance(ev, MetricsSampled):
                self._record(ev.sample, on_metrics)
                return ev.sample
            if isinstance(ev, RequestFinished):  # a request submitted meanwhile
                self._deliver(ev.output)
            elif isinstance(ev, RequestRefused):
                self._note_refusal(ev)
        return None

    def _deliver(self, out: RequestOutput, notify: bool = True) -> None:
        """A finished request: no longer outstanding, handed to the waiting call's ``on_result``, and kept for
        :meth:`generate` (or when no callback took it)."""
        self._outstanding.discard(out.request_id)
        callback = self._on_result if notify else None
        if self._keep_finished or callback is None:
            self._finished.append(out)
        if callback is not None:
            callback(out)

    def _record(self, sample: MetricSample, on_metrics=None) -> None:
        self._metrics.append(sample)
        if on_metrics:
            on_metrics(sample)

    @property
    def num_outstanding(self) -> int:
        """Requests submitted and not yet finished or refused (a cancelled one until its abort came back)."""
        return len(self._outstanding)

    @property
    def refused(self) -> dict[str, str]:
        """Request id -> why the scheduler refused it (e.g. larger than the KV pool, or over the max context):
        every refusal of a :meth:`generate` call, and the newest :data:`REFUSALS_KEPT` made outside one."""
        with self._refusal_lock:
            return {rid: why for rid, (_, why) in self._refused.items()}

    @property
    def truncated(self) -> dict[str, str]:
        """Request id -> how it was cut to the max context (``RuntimeOptions.truncate_context``); kept as
        :attr:`refused` is."""
        with self._refusal_lock:
            return dict(self._truncated)

    @property
    def metric_samples(self) -> list[MetricSample]:
        """The newest :data:`METRIC_SAMPLES_KEPT` samples, oldest first (a serving lane's go on while idle)."""
        return list(self._metrics)

    def reconfigure(self, gear: Gear, timeout_s: float = 300.0) -> list[dict]:
        """Move the same processes to ``gear``'s layer ranges and KV pool without a restart.

        Admission pauses, running sequences finish, every stage loads its new range and rebuilds its
        pool, then serving resumes with queued requests under the new gear's micro-batch size and
        in-flight limit. The stages and their replica counts must stay the same (the processes do).

        Raises:
            InputError: other stages or replica counts, or another model.
            InfeasibleError: the new gear does not fit, or its KV pool has fewer blocks than a replica's lanes.
            StageFailedError: a stage failed while reloading, or did not finish within ``timeout_s``.
        """
        if [st.replicas for st in gear.stages] != [st.replicas for st in self.gear.stages]:
            raise InputError("gear", "stages", f"reconfiguration keeps the processes: expected "
                             f"{self.gear.num_stages} stages with replicas {[st.replicas for st in self.gear.stages]}, "
                             f"got {gear.num_stages} with {[st.replicas for st in gear.stages]}")
        layout = gear_lane_layout(gear)
        check_gear_fits(gear, self.ckpt, self.options)
        self._cmds.put(Reconfigure(gear_id=gear.gear_id, ranges=tuple((a, b) for a, b in gear.layer_ranges()),
                                   num_blocks=kv_num_blocks(gear), block_size_tokens=gear.kv_block_size_tokens,
                                   micro_batch_size=gear.micro_batch_size,
                                   max_inflight_micro_batches=gear.max_inflight_micro_batches))
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() > deadline:
                self._fail("driver", f"reconfiguration did not finish within {timeout_s:.0f} s")
            ev = self._next_event(0.1)
            if ev is None:
                continue
            if isinstance(ev, Reconfigured):
                self.gear, self._layout = gear, layout
                self.worker_infos = sorted(ev.infos, key=worker_slot)
                return self.stage_info
            if isinstance(ev, RequestFinished):
                self._deliver(ev.output, notify=False)
            elif isinstance(ev, MetricsSampled):
                self._record(ev.sample)
            elif isinstance(ev, RequestRefused):  # (a cancelled one the ledger no longer waits for)
                self._note_refusal(ev)

    # -- watchdog ---------------------------------------------------------------------------------
    def _next_event(self, timeout_s: float):
        """One event from the processes, or ``None``; raises StageFailedError on any failure."""
        try:
            ev = self._events.get(timeout=timeout_s)
        except queue.Empty:
            ev = None
        if isinstance(ev, ProcessFailed):
            self._fail(ev.source, ev.message, first_error=ev)
        self._check_health()
        return ev

    def abort(self, reason: str) -> None:
        """Make the waiting call fail soon with ``reason`` (safe from a signal handler: only sets a
        flag the watchdog reads). A remote stage that went silent is still named as the cause."""
        self._abort_reason = reason

    def _check_health(self) -> None:
        if self._abort_reason is not None:
            self._fail("head", self._abort_reason)
        for i, p in enumerate(self._procs):
            if p.exitcode is not None:
                self._fail("driver" if i == 0 else i - 1, f"process exited with code {p.exitcode}")
            if getattr(p, "lost", None):
                self._fail(i - 1, p.lost)
        now = time.monotonic()
        limit = self.options.step_timeout_s
        c = self._counters
        for s in range(len(self._procs) - 1):
            started = c[counter_index(s + 1, WorkerCounter.STEP_STARTED)]
            if started and now - started > limit:
                self._fail(s, f"watchdog: one step has run for {now - started:.1f} s (limit {limit:.0f} s)")
        sent = c[counter_index(0, DriverCounter.MICRO_BATCHES_SENT)]
        done = c[counter_index(0, DriverCounter.MICRO_BATCHES_DONE)]
        if sent > done:  # work in flight: it must make progress
            mark = (sent, done)
            if self._stall_mark is None or self._stall_mark[0] != mark:
                self._stall_mark = (mark, now)
            elif now - self._stall_mark[1] > limit:
                stopped = next((w for w, p in enumerate(self._procs[1:]) if getattr(p, "pid", None)
                                and process_stopped(p.pid)), None)
                if stopped is not None:  # a stopped process holds up its neighbours: name it, not them
                    self._fail(stopped, f"watchdog: no progress for {now - self._stall_mark[1]:.1f} s; its process "
                                        f"is stopped (SIGSTOP, a debugger or a frozen cgroup; limit {limit:.0f} s)")
                oldest = done + 1  # micro-batches are served FIFO by every (non-replicated) stage
                lay = self._layout
                steps = [[c[counter_index(lay.rank(s, k), WorkerCounter.STEPS)] for k in range(r)]
                         for s, r in enumerate(lay.replicas)]
                stage = next((s for s in range(lay.num_stages) if sum(steps[s]) < oldest), lay.num_stages - 1)
                replica = min(range(lay.replicas[stage]), key=lambda k: steps[stage][k])  # the one that fell behind
                self._fail(lay.rank(stage, replica) - 1, f"watchdog: no progress for {now - self._stall_mark[1]:.1f} s; micro-batch "
                                   f"#{int(oldest)} is stuck at this stage (limit {limit:.0f} s)")
        else:
            self._stall_mark = None

    def _fail(self, stage: int | str, reason: str, first_error: ProcessFailed | None = None) -> None:
        """Collect reports for a moment, pick the culprit, kill every process, raise."""
        reports: dict[int | str, tuple[str, bool]] = {}  # source -> (message, in_transport)
        if first_error is not None:
            reports[first_error.source] = (first_error.message, first_error.in_transport)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                ev = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(ev, ProcessFailed):
                reports.setdefault(ev.source, (ev.message, ev.in_transport))
            elif isinstance(ev, RequestFinished):  # finished just before the failure: keep it
                self._deliver(ev.output)
        codes = {("driver" if i == 0 else i - 1): p.exitcode for i, p in enumerate(self._procs)}
        culprit, why = stage, reason
        killed = [s for s, code in codes.items() if code is not None and code < 0]
        own = [s for s, (msg, transport) in reports.items() if not transport]
        silent = [s for s, code in codes.items() if code is not None and s not in reports]
        now = time.monotonic()
        gone = sorted((i - 1 for i, p in enumerate(self._procs) if hasattr(p, "silent_for_s") and i - 1 not in reports
                       and p.exitcode is None and (p.silent_for_s(now) > SILENT_AT_FAILURE_S or p.placement_failure)),
                      key=lambda s: (not self._procs[s + 1].placement_failure,  # its placer saw it end: first
                                     -self._procs[s + 1].silent_for_s(now)))  # then the longest silent
        if reason.startswith("watchdog") or stage in gone:
            pass
        elif gone:  # a remote stage went quiet while its neighbours reported broken links: it died
            p = self._procs[gone[0] + 1]
            culprit, why = gone[0], p.placement_failure or (
                f"no heartbeat from {p.placed_on or p.host or 'its host'} (pid {p.pid}) for "
                f"{p.silent_for_s(now):.1f} s while its neighbours lost their links: process killed or host unreachable")
        elif killed:
            culprit, why = killed[0], f"process killed by signal {-codes[killed[0]]}"
        elif own:
            culprit, why = own[0], reports[own[0]][0]
        elif silent:
            culprit, why = silent[0], f"process exited with code {codes[silent[0]]}"
        self._started = False
        self._kill_all(grace_s=0.5)
        if isinstance(culprit, int):  # a worker: name its stage (and replica, when the stage has several)
            stage, replica = self._layout.locate(culprit)
            raise StageFailedError(stage, why, self._finished, replica if self._layout.replicas[stage] > 1 else None)
        raise StageFailedError(culprit, why, self._finished)
