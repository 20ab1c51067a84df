"""Stage workers on other hosts: the head's control store, remote stage handles, and the worker entry.

A pipeline normally spawns its stage workers as children (:class:`~flexpipe_dag.runtime.pipeline.PipelineRuntime`,
one host). With ``RuntimeOptions.control_address = "HOST:PORT"`` the head (the process that holds
the scheduler and the results) spawns only the driver and *waits for stage workers started
elsewhere*: ``flexpipe worker --head HOST:PORT --stage S`` on each stage's host, or every rank of
``flexpipe run --launched`` under DeepSpeed's launcher (hostfile) or ``torch.distributed.run``.

Everything between head and workers goes through the head's control store
(:mod:`~flexpipe_dag.runtime.control_store`), served on ``PORT`` of exactly the interface ``HOST``
names (the only port to open besides the backend's own data connections). Every process proves
the run secret (``--secret-file`` / :data:`~flexpipe_dag.runtime.control_auth.SECRET_FILE_ENV`,
:mod:`~flexpipe_dag.runtime.control_auth`) before it may read or write anything, every request is
MAC'd and sequenced, and a worker writes only the keys of the slot it claimed:

* ``claim/<w>``: a worker claims worker slot ``w`` (stage ``s`` without replicas; a second
  claimant is refused); its connections are then bound to ``w``;
* ``spec``: the :class:`~flexpipe_dag.runtime.worker.WorkerSpec` as JSON (layer ranges, KV pool,
  dtype, backend), published by the head; every worker loads *its own* copy of the model (same
  model name required, path may differ per host);
* ``pg/...``: the ``torch.distributed`` rendezvous of driver + stages (gloo on CPU, NCCL on GPU);
* ``events/<w>`` (a store queue): :class:`~flexpipe_dag.runtime.messages.StageReady` /
  :class:`~flexpipe_dag.runtime.messages.ProcessFailed` reports of worker ``w`` as JSON, the
  events local workers put on their ``multiprocessing`` queue (one naming another worker is dropped);
* ``hb/<w>``: a heartbeat every :data:`HEARTBEAT_PERIOD_S` carrying the stage's step counters
  (steps, busy seconds, age of the running step), mirrored by the head into the same counter
  array local workers write, so the watchdog and live metrics work unchanged;
* ``obs/<w>`` (a store queue): the stage's per-step observations (calibration rows), read from
  its own ring by the heartbeat thread and shipped with their times moved onto the head's clock;
* ``exit/<w>``: the worker's exit status; ``abort``: set by the head to stop every worker (a
  remote process cannot be killed from here; its heartbeat thread sees ``abort`` and exits).

A worker whose heartbeat stops (process killed, host lost) is named by the head's watchdog after
``heartbeat_timeout_s``; a worker that loses the head for as long exits on its own, so no stage is
left holding a GPU.

Nothing read from the store is unpickled: the spec and the events are JSON checked field by field
on receipt (:func:`~flexpipe_dag.runtime.messages.from_json`, a
:class:`~flexpipe_dag.runtime.messages.MessageError` names what is wrong), heartbeats and
observation rows fixed ``struct`` / ``float64`` layouts whose sizes are checked. A malformed
report is dropped and logged once per worker and kind; the run goes on.
"""

from __future__ import annotations

import array
import logging
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING

from flexpipe_dag.core.errors import InputError, first_line
from flexpipe_dag.runtime.control_auth import SECRET_FILE_ENV, SecretRefused, new_secret
from flexpipe_dag.runtime.control_store import ClaimRefused, ControlStoreServer, StoreLimits
from flexpipe_dag.runtime.messages import (
    COUNTER_SLOTS,
    MessageError,
    ProcessFailed,
    StageReady,
    WorkerCounter,
    counter_index,
    from_json,
    to_json,
)
from flexpipe_dag.runtime.rendezvous import connect, parse_address
from flexpipe_dag.runtime.worker import WorkerSpec

if TYPE_CHECKING:
    from flexpipe_dag.runtime.observations import RingReader

log = logging.getLogger(__name__)

__all__ = ["ControlServer", "HeartbeatCounters", "RemoteStage", "StoreEvents", "connect", "fetch_spec",
           "parse_address", "serve_stage"]

#: Seconds between a remote worker's heartbeats (and the head's polls of the store).
HEARTBEAT_PERIOD_S = 0.2
#: Default seconds without a heartbeat before a remote stage (or the head, seen from a worker) is lost.
DEFAULT_HEARTBEAT_TIMEOUT_S = 15.0
#: A remote stage silent this long when a run fails is taken as the failure's cause.
SILENT_AT_FAILURE_S = 3 * HEARTBEAT_PERIOD_S + 0.2
_HB = struct.Struct(f"<qd{COUNTER_SLOTS}d")  # sequence, sender's monotonic clock, the worker's counter row
_OBS = struct.Struct("<dq")  # sender's monotonic clock, rows dropped so far; then float64 ring rows
#: Most observation rows in one pushed item (keeps each under the store's value limit).
_OBS_ROWS_PER_ITEM = 1024


class StoreEvents:
    """Worker side of the event channel: ``put(event)`` pushes a :class:`StageReady` or
    :class:`ProcessFailed` as JSON onto worker ``worker``'s store queue. ``on_ready(info)`` is called
    with the stage's :class:`~flexpipe_dag.runtime.messages.StageInfo` (its observation ring's path)."""

    def __init__(self, store, worker: int, on_ready=None, name: str = "worker"):
        self._store, self._queue = store, f"events/{worker}"
        self._lock = threading.Lock()
        self._on_ready = on_ready
        self.name = name

    def put(self, event: StageReady | ProcessFailed) -> None:
        """Send ``event`` to the head (best effort: a head that is gone cannot hear it); a failure is
        also printed here, so the worker's own host shows why it stopped."""
        if isinstance(event, StageReady) and self._on_ready is not None:
            self._on_ready(event.info)
        if isinstance(event, ProcessFailed):
            print(f"flexpipe worker ({self.name}): {event.message.strip().splitlines()[0]}", file=sys.stderr, flush=True)
        try:
            with self._lock:
                self._store.queue_push(self._queue, to_json(event))
        except Exception:
            pass


class HeartbeatCounters:
    """Worker side of the counters: the same indexable ``double`` array a local worker writes, plus a
    thread that publishes this rank's fields every :data:`HEARTBEAT_PERIOD_S`, and exits the
    process when the head sets ``abort`` or cannot be reached for ``head_timeout_s``."""

    def __init__(self, store, worker: int, world_size: int, head_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 name: str = ""):
        self.name = name or f"worker {worker}"
        self._values = array.array("d", [0.0] * (COUNTER_SLOTS * world_size))
        self._store = store.clone()
        self.worker, self._base = worker, counter_index(worker + 1, 0)
        self._head_timeout_s = head_timeout_s
        self._stop = threading.Event()
        self._ring: RingReader | None = None  # this stage's observation ring, once loaded
        self._thread = threading.Thread(target=self._beat, name=f"flexpipe-heartbeat-{worker}", daemon=True)
        self._thread.start()

    def watch_ring(self, info) -> None:
        """Ship the rows of the stage's observation ring (``info.observations_path``, a
        :class:`~flexpipe_dag.runtime.messages.StageInfo`) to the head."""
        from flexpipe_dag.runtime.observations import RingReader

        if info.observations_path:
            self._ring = RingReader(info.observations_path)

    def __getitem__(self, i: int) -> float:
        return self._values[i]

    def __setitem__(self, i: int, v: float) -> None:
        self._values[i] = v

    def close(self) -> None:
        """Stop beating; ship the last observation rows (before the exit status is published)."""
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self._ship_observations()
        except Exception:
            pass

    def _beat(self) -> None:
        seq, last_ok = 0, time.monotonic()
        while not self._stop.wait(HEARTBEAT_PERIOD_S):
            seq += 1
            try:
                fields = self._values[self._base:self._base + COUNTER_SLOTS]
                self._store.set(f"hb/{self.worker}", _HB.pack(seq, time.monotonic(), *fields))
                self._ship_observations()
                if self._store.check(["abort"]):
                    print(f"flexpipe worker ({self.name}): the head stopped the pipeline "
                          f"({self._store.get('abort').decode()}); exiting", file=sys.stderr, flush=True)
                    self._store.set(f"exit/{self.worker}", "1")  # the head is waiting to see this worker go
                    os._exit(1)
                last_ok = time.monotonic()
            except Exception as exc:
                if self._stop.is_set():
                    return
                if time.monotonic() - last_ok > self._head_timeout_s:
                    print(f"flexpipe worker ({self.name}): lost the head for {self._head_timeout_s:.0f} s "
                          f"({type(exc).__name__}: {exc}); exiting", file=sys.stderr, flush=True)
                    os._exit(1)

    def _ship_observations(self) -> None:
        ring = self._ring
        if ring is None:
            return
        rows = ring.read_new()
        for i in range(0, len(rows), _OBS_ROWS_PER_ITEM):
            header = _OBS.pack(time.monotonic(), ring.dropped)
            self._store.queue_push(f"obs/{self.worker}", header + rows[i:i + _OBS_ROWS_PER_ITEM].astype("<f8").tobytes())


class RemoteStage:
    """Head-side handle of a stage worker on another host, with the ``multiprocessing.Process``
    surface the runtime's watchdog uses (``pid``, ``exitcode``, ``is_alive``, ``join``, ``kill``)
    plus ``host``, :meth:`silent_for_s` and :attr:`lost`."""

    def __init__(self, server: ControlServer, worker: int):
        self._server, self.worker = server, worker
        self.pid: int | None = None
        self.host: str | None = None
        self.exitcode: int | None = None
        self.last_beat: float | None = None  # head's monotonic clock at the last new heartbeat
        self._seq = -1
        self._rows: list = []  # observation rows received, not yet read
        self.dropped = 0  # rows the worker's ring overwrote before they were shipped
        #: where a placer (Ray) put it, for messages: ``host 'node-b' (Ray node ..., resource ...)``
        self.placed_on: str | None = None
        #: why the placer saw its process end (set by :class:`~flexpipe_dag.runtime.ray_placement.StageWorkers`)
        self.placement_failure: str | None = None

    def read_new(self):
        """Observation rows received since the last call, ``(n, NUM_COLUMNS)`` float64 with ``t_end_s``
        on the head's clock (the :class:`~flexpipe_dag.runtime.observations.RingReader` interface)."""
        import numpy as np

        from flexpipe_dag.runtime.observations import NUM_COLUMNS

        rows, self._rows = self._rows, []
        return np.concatenate(rows) if rows else np.zeros((0, NUM_COLUMNS))

    def silent_for_s(self, now: float | None = None) -> float:
        """Seconds since the last new heartbeat (0 before the first one)."""
        if self.last_beat is None:
            return 0.0
        return (now or time.monotonic()) - self.last_beat

    @property
    def lost(self) -> str | None:
        """Why this stage counts as gone (its placer saw its process end, or no heartbeat for the
        timeout), else ``None``."""
        if self.placement_failure is not None and self.exitcode is None:
            return self.placement_failure
        if self.exitcode is None and self.silent_for_s() > self._server.heartbeat_timeout_s:
            return (f"no heartbeat from {self.placed_on or self.host or 'its host'} (pid {self.pid}) for "
                    f"{self.silent_for_s():.1f} s (limit {self._server.heartbeat_timeout_s:.0f} s): "
                    f"process killed, hung or host unreachable")
        return None

    def is_alive(self) -> bool:
        return self.exitcode is None and self.lost is None

    def join(self, timeout: float | None = None) -> None:
        if self.pid is None and self.last_beat is None:
            return  # never joined: nothing to wait for
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.exitcode is None and self.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> None:
        self._server.abort("the head killed the pipeline")


class ControlServer:
    """The head's control store and the thread that mirrors remote workers into the local runtime.

    Args:
        port: TCP port to serve on; 0 lets the kernel pick one (see :attr:`port`).
        num_workers: stage workers the pipeline needs (one per stage replica).
        heartbeat_timeout_s: silence after which a stage is reported lost.
        host: the interface to bind, exactly (``0.0.0.0`` / ``::``: every interface, on request only).
        secret: the run secret workers must prove (``None``: a fresh one, :attr:`secret`).
        limits: the store's quotas (:class:`~flexpipe_dag.runtime.control_store.StoreLimits`).

    Raises:
        InputError: the address cannot be bound.
    """

    def __init__(self, port: int, num_workers: int, heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 host: str = "127.0.0.1", secret: str | None = None, limits: StoreLimits | None = None):
        #: the run secret every worker must hold
        self.secret = secret or new_secret()
        try:
            self.server = ControlStoreServer(host, port, self.secret, num_workers, limits)
        except OSError as exc:
            raise InputError(None, "control address (--listen / control_address)",
                             f"cannot serve the control store on {host}:{port}: {exc}") from None
        self.port = self.server.port
        self._host = host if host not in ("", "0.0.0.0", "::") else socket.gethostname()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers = [RemoteStage(self, w) for w in range(num_workers)]
        self._main = self.server.local
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: (worker, what) -> reports dropped as malformed (logged once each)
        self.ignored: dict[tuple[int, str], int] = {}

    @property
    def address(self) -> str:
        """``host:port`` workers can use (the host given to listen on, else this host's name)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    @property
    def local_address(self) -> str:
        """``host:port`` a process on this host (the driver) reaches the store at."""
        host = self.server.connect_host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def publish(self, spec: WorkerSpec) -> None:
        """Hand the pipeline spec to the workers (they block on it after claiming their stage); the
        secret is left out (every worker holds it already)."""
        import dataclasses

        self._main.set("spec", to_json(dataclasses.replace(spec, control_secret="")))

    def claimed(self) -> list[int]:
        """Worker slots claimed so far."""
        return [w for w in range(len(self.workers)) if self._main.claimed(w)]

    def abort(self, reason: str) -> None:
        """Tell every remote worker to exit (idempotent)."""
        try:
            self._main.set("abort", reason)
        except Exception:
            pass

    def start(self, events: queue.Queue, counters) -> None:
        """Start mirroring: remote events onto ``events``, heartbeats into ``counters``."""
        self._sinks = (events, counters)
        self._thread = threading.Thread(target=self._pump, args=(events, counters),
                                        name="flexpipe-control-pump", daemon=True)
        self._thread.start()

    def close(self, abort_grace_s: float = 4 * HEARTBEAT_PERIOD_S) -> None:
        """Stop mirroring after one last pass, then close the store; after :meth:`abort`, first give
        live workers up to ``abort_grace_s`` to read it (their next heartbeat) and report their exit."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            deadline = time.monotonic() + (abort_grace_s if self._main.check(["abort"]) else 0.0)
            while True:
                try:
                    self.poll(*self._sinks)
                except Exception:
                    break
                if time.monotonic() >= deadline or not any(st.last_beat is not None and st.is_alive()
                                                           for st in self.workers):
                    break
                time.sleep(HEARTBEAT_PERIOD_S / 4)
        self.server.close()

    def _pump(self, events, counters) -> None:
        try:
            while not self._stop.is_set():
                self.poll(events, counters)
                self._stop.wait(HEARTBEAT_PERIOD_S / 4)
        except Exception as exc:
            if not self._stop.is_set():
                events.put(ProcessFailed("driver", f"control store failed: {type(exc).__name__}: {exc}", True))

    def _ignore(self, worker: int, what: str, why: object) -> None:
        key = (worker, what)
        self.ignored[key] = self.ignored.get(key, 0) + 1
        if self.ignored[key] == 1:
            log.warning("control store: dropped a malformed %s from worker slot %d: %s (further ones counted)",
                        what, worker, why)

    def poll(self, events, counters) -> None:
        """One pass (public for tests): drain every worker's event queue, mirror heartbeats, exit codes
        and observation rows. A malformed report (not a valid :class:`StageReady` /
        :class:`ProcessFailed`, one naming another worker, a heartbeat or observation item of the
        wrong size, an exit status that is not an integer) is dropped and counted in :attr:`ignored`."""
        with self._lock:
            now = time.monotonic()
            for st in self.workers:
                self._receive_events(st, events)
                self._receive_observations(st, now)
                self._receive_status(st, counters, now)

    def _receive_events(self, st: RemoteStage, events) -> None:
        store, w = self._main, st.worker
        while store.queue_len(f"events/{w}") > 0:
            try:
                ev = from_json((StageReady, ProcessFailed), store.queue_pop(f"events/{w}"), f"worker slot {w}")
            except MessageError as exc:
                self._ignore(w, "event", exc)
                continue
            sender = ev.worker if isinstance(ev, StageReady) else ev.source
            if sender != w:
                self._ignore(w, "event", f"it names worker {sender!r}")
                continue
            if isinstance(ev, StageReady):
                st.pid, st.host = ev.info.pid, ev.info.host
            events.put(ev)

    def _receive_status(self, st: RemoteStage, counters, now: float) -> None:
        store, w = self._main, st.worker
        if st.exitcode is None and store.check([f"exit/{w}"]):
            try:
                st.exitcode = int(store.get(f"exit/{w}"))
            except ValueError as exc:
                store.delete_key(f"exit/{w}")  # before counting it, so a good one written after is kept
                self._ignore(w, "exit status", exc)
        if not store.check([f"hb/{w}"]):
            return
        blob = store.get(f"hb/{w}")
        if len(blob) != _HB.size:
            store.delete_key(f"hb/{w}")  # before counting it (a reader of ``ignored`` may write a good one)
            self._ignore(w, "heartbeat", f"{len(blob)} bytes, expected {_HB.size}")
            return
        seq, sent_at, *fields = _HB.unpack(blob)
        if seq == st._seq:
            return
        st._seq, st.last_beat = seq, now
        base = counter_index(w + 1, 0)
        for i, v in enumerate(fields):
            if i == WorkerCounter.STEP_STARTED and v:
                v = now - (sent_at - v)  # the worker's clock -> ours, via the step's age
            counters[base + i] = v

    def _receive_observations(self, st: RemoteStage, now: float) -> None:
        import numpy as np

        from flexpipe_dag.runtime.observations import COLUMNS, NUM_COLUMNS

        t_end = COLUMNS.index("t_end_s")
        store, key = self._main, f"obs/{st.worker}"
        while store.queue_len(key) > 0:
            blob = store.queue_pop(key)
            if len(blob) < _OBS.size or (len(blob) - _OBS.size) % (8 * NUM_COLUMNS):
                self._ignore(st.worker, "observation item", f"{len(blob)} bytes is not a header + whole rows")
                continue
            sent_at, st.dropped = _OBS.unpack_from(blob)
            rows = np.frombuffer(blob, dtype="<f8", offset=_OBS.size).reshape(-1, NUM_COLUMNS).copy()
            rows[:, t_end] = now - (sent_at - rows[:, t_end])  # the worker's clock -> ours
            st._rows.append(rows)


#: The flag a worker names when its secret is missing or wrong.
SECRET_FLAG = f"--secret-file (or {SECRET_FILE_ENV})"


def fetch_spec(host: str, port: int, timeout_s: float, secret: str):
    """Connect to a head's control store with the run ``secret`` and read its spec, in at most
    ``timeout_s``: ``(store, spec)``.

    Runs on a helper thread, so a port that accepts but never answers cannot hold the worker.

    Raises:
        InputError: the head refused the secret (naming ``--secret-file``), or no head answered in
            time (naming ``--head``).
    """
    box: dict = {}

    def attempt() -> None:
        try:
            store = connect(host, port, timeout_s, secret)
            box["value"] = (store, store.get("spec"))
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=attempt, name="flexpipe-connect", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if "value" in box:
        store, blob = box["value"]
        try:
            return store, from_json(WorkerSpec, blob, f"the head at {host}:{port}")
        except MessageError as exc:
            raise InputError(None, "--head", f"the head at {host}:{port} sent a pipeline spec this worker cannot "
                                             f"read (another FlexPipe version?): {exc}") from None
    if isinstance(box.get("error"), SecretRefused):
        raise InputError(None, SECRET_FLAG, f"the head at {host}:{port} refused this worker's run secret "
                                            f"({box['error']}); expected the secret file that head wrote") from None
    why = first_line(box["error"]) if "error" in box else "no answer (is that port a FlexPipe head?)"
    raise InputError(None, "--head", f"no FlexPipe head answered at {host}:{port} within {timeout_s:.0f} s: {why}")


def serve_stage(head: str, stage: int | None = None, model=None, device: str | None = None, local_rank: int = 0,
                connect_timeout_s: float = 600.0, threads: int | None = None, replica: int = 0,
                worker: int | None = None, secret: str | None = None) -> int:
    """Run one replica of one stage of the pipeline whose head serves ``head`` (``HOST:PORT``) until it stops.

    Waits for the head's spec, claims ``(stage, replica)`` (or worker index ``worker``, rank - 1
    under a launcher), loads that stage's layers of ``model`` (resolved on this host: an HF
    directory, GGUF file, or ``None`` for SmolLM2; it must be the model the head serves), joins
    the process group and serves. On a CUDA pipeline the stage runs on ``cuda:<local_rank mod this
    host's GPU count>``; ``device`` (``"cpu"`` / ``"cuda"``), when given, must match the head's.
    ``secret`` is the run secret (the file the head wrote; ``None``: read from
    :data:`~flexpipe_dag.runtime.control_auth.SECRET_FILE_ENV` / ``FLEXPIPE_RUN_SECRET``).
    Returns the exit status (0 after a clean stop).

    Raises:
        InputError: no secret or a wrong one, a bad address, no head, a stage / replica outside the
            gear or already served, another model or device.
    """
    from flexpipe_dag.runtime.control_auth import secret_from_env
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.runtime.worker import worker_main

    host, port = parse_address(head, "--head")
    secret = secret or secret_from_env()
    if secret is None:
        raise InputError(None, SECRET_FLAG, "expected the run's secret: the file the head wrote (its startup "
                                            "message names it), or FLEXPIPE_RUN_SECRET")
    if stage is None and worker is None:
        raise InputError(None, "--stage", "expected a stage index")
    for flag, value in (("--stage", stage), ("--replica", replica), ("RANK", worker)):
        if value is not None and value < 0:
            raise InputError(None, flag, f"expected an index >= 0, got {value}")
    store, spec = fetch_spec(host, port, connect_timeout_s, secret)  # the head first: no model loaded for a wrong port
    ckpt = resolve_checkpoint(model)
    layout = spec.layout()
    if worker is None:
        if stage >= spec.num_stages:
            raise InputError(None, "--stage", f"the head's gear has {spec.num_stages} stages (0..{spec.num_stages - 1}), "
                                              f"got {stage}")
        if replica >= layout.replicas[stage]:
            raise InputError(None, "--replica", f"stage {stage} has {layout.replicas[stage]} replica(s) "
                                                f"(0..{layout.replicas[stage] - 1}), got {replica}")
        worker = layout.rank(stage, replica) - 1
    elif worker >= layout.num_workers:
        raise InputError(None, "WORLD_SIZE", f"the head's gear has {layout.num_workers} stage workers; rank "
                                             f"{worker + 1} has none (launch {layout.world_size} ranks)")
    stage, replica = layout.locate(worker)
    name = f"stage {stage}" + (f" replica {replica}" if layout.replicas[stage] > 1 else "")
    # refused before claiming: a mistyped worker must not take the slot, nor fail the head's run
    if device is not None and device != spec.device:
        raise InputError(None, "--device", f"the head runs the pipeline on {spec.device!r}, this worker asked for {device!r}")
    if spec.checkpoint_fingerprint and ckpt.fingerprint != spec.checkpoint_fingerprint:
        raise InputError(None, "--model", f"the head serves {spec.checkpoint_name!r} (weights {spec.checkpoint_fingerprint}); "
                                          f"{ckpt.path} holds other weights ({ckpt.fingerprint})")
    try:
        store.claim(worker)
    except ClaimRefused:
        raise InputError(None, "--stage", f"{name} already has a worker at {host}:{port}") from None
    spec.checkpoint_path = str(ckpt.path)
    spec.control_address = f"{host}:{port}"
    spec.control_secret = secret
    if spec.device == "cuda":  # modulo: the head's host also gives the head a local rank (it takes no GPU)
        import torch

        spec.device = f"cuda:{local_rank % max(1, torch.cuda.device_count())}"
    if threads:
        spec.threads_per_rank = threads
    counters = HeartbeatCounters(store, worker, spec.world_size, name=name)
    events = StoreEvents(store, worker, on_ready=counters.watch_ring, name=name)
    result: dict = {"code": 0}

    def serve() -> None:
        try:
            worker_main(worker, spec, events, counters)
        except SystemExit as exc:
            result["code"] = int(exc.code or 0)

    def on_sigterm(signum, _frame) -> None:  # a launcher stopping every rank: say so, then go
        try:
            events.put(ProcessFailed(worker, f"stopped by signal {signum}", True))
            store.set(f"exit/{worker}", str(128 + signum))
        finally:
            os._exit(128 + signum)

    # the stage serves on a thread so this (main) thread stays free to run the signal handler: a
    # thread blocked in a backend receive would never run it
    thread = threading.Thread(target=serve, name=f"flexpipe-worker-{worker}", daemon=True)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
    counters.close()
    try:
        store.set(f"exit/{worker}", str(result["code"]))
    except Exception:
        pass
    return result["code"]
