"""Stage workers placed and started by Ray: each on the host its gear names, with nobody involved.

A gear's stages name devices; the cluster profile says which host holds each device
(:attr:`~flexpipe_dag.core.cluster.Device.node_id`). :class:`RayPlacement` maps every FlexPipe
host to a Ray *custom resource*, ``flexpipe_host_<node_id>`` (:func:`host_resource`), which the
operator gives the Ray node on that host when starting it::

    ray start --address=HEAD_IP:6379 --node-ip-address=THIS_IP --resources='{"flexpipe_host_gpu-v100-1": 8}'

(``N`` = the most stage workers that host may run at once: one per device is the usual figure).
For a pipeline with ``RuntimeOptions(placement=RayPlacement(...))``,
:meth:`PipelineRuntime.start <flexpipe_dag.runtime.pipeline.PipelineRuntime.start>` serves its
control store as for workers started by hand, then starts one Ray actor per stage worker
(:class:`StageWorkers`), each requesting ``{resource_of_its_host: resource_per_worker}``, so Ray
puts it on that host. The actor runs the ordinary worker entry point
(:func:`~flexpipe_dag.runtime.remote.serve_stage`, what ``flexpipe worker --head`` runs) in its own
process: it connects to the head's control store, proves the run secret, claims its stage, loads
its layers and serves. The data path is FlexPipe's own (control store + ``torch.distributed``);
Ray only places, starts, supervises and finally kills the processes. A gear shift's new gear
(:class:`~flexpipe_dag.shift.executor.GearExecutor`) inherits the running pipeline's options, so
its workers are placed the same way, on the hosts the new gear names.

Before anything starts, every host the gear needs must have a live Ray node offering its
resource: otherwise :class:`~flexpipe_dag.core.errors.InfeasibleError` names the host, the stage,
the resource expected and the ``ray start`` flag that provides it.

Failures: a worker actor that dies (its process killed, its Ray node gone) is seen by Ray; the
monitor thread of :class:`StageWorkers` records the reason on the stage's
:class:`~flexpipe_dag.runtime.remote.RemoteStage` handle (``placement_failure``), so the
pipeline's watchdog fails the run naming the stage, its FlexPipe host and the Ray node, as fast
as FlexPipe's own heartbeat / broken-link detection would or faster. A
:class:`~flexpipe_dag.shift.router.ServingRouter` then re-submits the failed lane's unfinished
requests to its fallback / entry lane (``lane_failed``): nothing is lost.

Security: Ray's own ports (GCS, raylets, object manager, workers) have no authentication, and
Ray serialises task arguments with pickle: anyone who can reach them can run code on every node.
Run Ray only on a trusted private network. The run secret travels to the actors in their task
arguments (over Ray's channel) unless :attr:`RayPlacement.secret_file` names a copy of it on
every host. ``deploy/MULTIHOST.md`` has the commands.

``ray`` is imported lazily: without it only placement with Ray is refused
(:func:`import_ray`, naming the install command).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flexpipe_dag.core.errors import FlexPipeError, InfeasibleError, InputError, first_line

if TYPE_CHECKING:
    from flexpipe_dag.core.cluster import ClusterProfile
    from flexpipe_dag.core.gear import Gear

log = logging.getLogger(__name__)

__all__ = ["RESOURCE_PREFIX", "RayPlacement", "RayUnavailableError", "StageWorkers", "WorkerPlacement",
           "host_resource", "import_ray"]

#: Prefix of the custom resource that marks a FlexPipe host's Ray node: ``flexpipe_host_<node_id>``.
RESOURCE_PREFIX = "flexpipe_host_"
#: Seconds between the monitor's looks at the worker actors.
MONITOR_PERIOD_S = 0.2
#: How the placement is installed.
INSTALL_HINT = 'pip install "ray[default]>=2.40,<3"  (or: pip install -e ".[runtime]")'


class RayUnavailableError(FlexPipeError):
    """Ray is not installed, or its cluster cannot be reached."""


def import_ray():
    """The ``ray`` module.

    Raises:
        RayUnavailableError: it is not installed (naming the install command).
    """
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailableError(f"placement with Ray needs the ray package, which is not installed "
                                  f"({exc}); install it with: {INSTALL_HINT}") from None
    return ray


def host_resource(host: str, prefix: str = RESOURCE_PREFIX) -> str:
    """The Ray custom resource that marks FlexPipe host ``host``'s node: ``flexpipe_host_<host>``."""
    return f"{prefix}{host}"


@dataclass
class RayPlacement:
    """Where and how Ray starts a pipeline's stage workers (``RuntimeOptions.placement``).

    Attributes:
        hosts: device id -> FlexPipe host (``Device.node_id``; :meth:`from_profile` fills it from a
            cluster profile). Every device of the gear must be listed.
        address: the Ray cluster to join (``"HOST:PORT"`` of its GCS, as given to ``ray start
            --address``); ``None``: ``RAY_ADDRESS`` or the cluster running on this host (``"auto"``).
        node_ip_address: this head's address as the Ray cluster sees it (``ray.init``'s
            ``_node_ip_address``); ``None``: Ray's guess.
        head_host: the interface the head's control store binds when ``RuntimeOptions.control_address``
            is unset (port 0: picked by the kernel, so a shift's second pipeline never clashes);
            ``None``: :attr:`node_ip_address`, else the address Ray reports for this node.
        resource_prefix: the custom resources' prefix (:data:`RESOURCE_PREFIX`).
        resource_per_worker: how much of its host's resource each worker actor takes (1: a host
            started with ``N`` runs at most ``N`` stage workers at once).
        num_cpus: CPUs each actor reserves in Ray's accounting (0: placement by the host resource alone;
            the stage runs ``threads_per_rank`` threads whatever Ray reserves).
        num_gpus: GPUs each actor reserves (``None``: 1 on a CUDA pipeline, else 0). Ray then sets
            the actor's ``CUDA_VISIBLE_DEVICES`` to that GPU, which the stage takes as ``cuda:0``.
        model: the model on the worker hosts (an HF directory or GGUF file, the same weights as the
            head's); ``None``: the head's checkpoint path, which must then exist on every host.
        secret_file: a copy of the run secret at this path on every host; ``None``: the secret is
            passed in the actors' task arguments (over Ray's channel: trusted network only).
        env: environment variables set in each actor's process before the worker starts
            (``OMP_NUM_THREADS``, ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, ...).
        connect_timeout_s: how long a worker actor waits for the head's control store.
        init_kwargs: extra keyword arguments of ``ray.init`` (e.g. ``namespace``).
    """

    hosts: Mapping[str, str] = field(default_factory=dict)
    address: str | None = None
    node_ip_address: str | None = None
    head_host: str | None = None
    resource_prefix: str = RESOURCE_PREFIX
    resource_per_worker: float = 1.0
    num_cpus: float = 0.0
    num_gpus: float | None = None
    model: str | None = None
    secret_file: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    connect_timeout_s: float = 600.0
    init_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_profile(cls, profile: ClusterProfile, **kwargs: Any) -> RayPlacement:
        """A placement whose :attr:`hosts` come from ``profile`` (each device's ``node_id``)."""
        hosts = {d.device_id: d.node_id for d in profile.devices}
        hosts.update(kwargs.pop("hosts", {}) or {})
        return cls(hosts=hosts, **kwargs)

    def resource(self, host: str) -> str:
        """The custom resource of FlexPipe host ``host`` (:func:`host_resource`)."""
        return host_resource(host, self.resource_prefix)

    def workers(self, gear: Gear) -> list[WorkerPlacement]:
        """Per stage worker (stage order, replicas together, as the worker slots): its host and resource.

        Raises:
            InputError: a device of the gear that :attr:`hosts` does not map to a host.
        """
        out: list[WorkerPlacement] = []
        for st in gear.stages:
            for k, dev in enumerate(st.device_ids):
                host = self.hosts.get(dev)
                if not host:
                    known = ", ".join(sorted(self.hosts)[:8]) or "none"
                    raise InputError("RayPlacement", "hosts",
                                     f"stage {st.stage_index} runs on device {dev!r}, which no host holds "
                                     f"(devices mapped: {known}); expected a device id -> node_id entry, e.g. "
                                     f"from the cluster profile (RayPlacement.from_profile)")
                out.append(WorkerPlacement(len(out), st.stage_index, k, st.replicas, dev, host, self.resource(host)))
        return out

    def validate(self) -> None:
        """Refuse bad figures before anything starts.

        Raises:
            InputError: naming the field.
        """
        if not self.resource_per_worker > 0:
            raise InputError("RayPlacement", "resource_per_worker", f"expected a number > 0, got {self.resource_per_worker}")
        if self.num_cpus < 0 or (self.num_gpus is not None and self.num_gpus < 0):
            raise InputError("RayPlacement", "num_cpus", "expected numbers >= 0")
        if not self.connect_timeout_s > 0:
            raise InputError("RayPlacement", "connect_timeout_s", f"expected a positive number, got {self.connect_timeout_s}")


@dataclass(frozen=True)
class WorkerPlacement:
    """One stage worker's place: worker slot, stage, replica, device, FlexPipe host, Ray resource."""

    worker: int
    stage: int
    replica: int
    replicas: int
    device_id: str
    host: str
    resource: str

    @property
    def name(self) -> str:
        return f"stage {self.stage}" + (f" replica {self.replica}" if self.replicas > 1 else "")


def connect_ray(placement: RayPlacement):
    """``ray`` initialised in this process against the placement's cluster (joined once per process).

    Raises:
        RayUnavailableError: not installed, or no cluster answers at the address.
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"address": placement.address or "auto", "logging_level": logging.WARNING,
                              "log_to_driver": False, **dict(placement.init_kwargs)}
    if placement.node_ip_address:
        kwargs["_node_ip_address"] = placement.node_ip_address
    try:
        ray.init(**kwargs)
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError by Ray version
        raise RayUnavailableError(f"cannot join the Ray cluster at {kwargs['address']}: {first_line(exc)}; "
                                  f"start one with `ray start --head ...` (deploy/MULTIHOST.md) or set "
                                  f"RayPlacement.address") from None
    return ray


def _offered(ray) -> dict[str, list[tuple[str, float]]]:
    """Custom resource -> [(Ray node id, amount)] over the cluster's live nodes."""
    out: dict[str, list[tuple[str, float]]] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        for name, amount in (node.get("Resources") or {}).items():
            out.setdefault(name, []).append((node["NodeID"], float(amount)))
    return out


def check_hosts(placement: RayPlacement, gear: Gear, ray=None) -> list[WorkerPlacement]:
    """The gear's worker places, each host checked to have a live Ray node offering its resource.

    Raises:
        InputError: a device without a host.
        InfeasibleError: a host with no Ray node (naming the host, its stages and the resource
            expected), or whose nodes offer less of it than its workers take.
    """
    placement.validate()
    places = placement.workers(gear)
    ray = ray or connect_ray(placement)
    offered = _offered(ray)
    need: dict[str, list[WorkerPlacement]] = {}
    for p in places:
        need.setdefault(p.host, []).append(p)
    for host, ps in need.items():
        res = placement.resource(host)
        stages = ", ".join(p.name for p in ps)
        nodes = offered.get(res, [])
        if not nodes:
            raise InfeasibleError(
                f"host {host!r} ({stages}) has no Ray node: no live node of the Ray cluster offers the custom "
                f"resource {res!r}; start one on that host with `ray start --address=<ray head>:<port> "
                f"--resources='{{\"{res}\": {len(ps)}}}'`")
        total = sum(a for _, a in nodes)
        wanted = len(ps) * placement.resource_per_worker
        if total < wanted:
            raise InfeasibleError(
                f"host {host!r} ({stages}) needs {wanted:g} of the Ray resource {res!r} "
                f"({placement.resource_per_worker:g} per stage worker) but its Ray node(s) offer {total:g}")
    return places


class _StageWorkerActor:
    """The Ray actor: one stage worker, in the actor's own process (made a Ray actor class by
    :class:`StageWorkers`, so this module imports without Ray)."""

    def where(self) -> dict:
        import socket

        import ray

        return {"ray_node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "hostname": socket.gethostname()}

    def serve(self, head: str, stage: int, replica: int, model: str | None, device: str, secret: str | None,
              secret_file: str | None, env: dict, connect_timeout_s: float) -> int:
        """Run :func:`~flexpipe_dag.runtime.remote.serve_stage` (``flexpipe worker``'s entry point) here."""
        os.environ.update({str(k): str(v) for k, v in env.items()})
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        from flexpipe_dag.runtime.control_auth import resolve_secret
        from flexpipe_dag.runtime.remote import serve_stage

        if secret_file:
            secret = resolve_secret(secret_file)
        return serve_stage(head, stage, model=model, device=device, local_rank=0,
                           connect_timeout_s=connect_timeout_s, replica=replica, secret=secret)


class StageWorkers:
    """A pipeline's stage workers as Ray actors: started on their hosts, watched, killed at the end.

    Args:
        placement: :class:`RayPlacement`.
        places: from :func:`check_hosts` (one per worker slot).
        head: ``HOST:PORT`` of the head's control store, as the worker hosts reach it.
        secret: the run secret.
        device: ``"cpu"`` or ``"cuda"`` (the pipeline's).
        model: the model path for the workers (``RayPlacement.model`` or the head's).
        on_failure: ``(worker slot, reason) -> None``, called once from the monitor thread when a
            worker's actor ends with an error (process killed, node lost) while the pipeline runs.
    """

    def __init__(self, placement: RayPlacement, places: list[WorkerPlacement], head: str, secret: str,
                 device: str, model: str, on_failure=None, ray=None):
        self.placement, self.places, self.head = placement, places, head
        self._ray = ray or connect_ray(placement)
        self._on_failure = on_failure
        self._actors: list[Any] = []
        self._refs: dict[Any, int] = {}  # serve() ref -> worker slot
        self._where: dict[int, dict] = {}
        self._where_refs: list[Any] = []
        self._closed = threading.Event()
        self.failures: dict[int, str] = {}
        self._secret, self._device, self._model = secret, device, model
        self._monitor: threading.Thread | None = None

    def start(self) -> None:
        """Create one actor per worker on its host's resource and start its ``serve`` call."""
        ray, pl = self._ray, self.placement
        cls = ray.remote(max_restarts=0, max_task_retries=0)(_StageWorkerActor)
        gpus = pl.num_gpus if pl.num_gpus is not None else (1.0 if self._device.startswith("cuda") else 0.0)
        secret = None if pl.secret_file else self._secret
        for p in self.places:
            actor = cls.options(resources={p.resource: pl.resource_per_worker}, num_cpus=pl.num_cpus,
                                num_gpus=gpus, name=None).remote()
            self._actors.append(actor)
            self._where_refs.append(actor.where.remote())  # runs first: the actor's calls run in order
            ref = actor.serve.remote(self.head, p.stage, p.replica, self._model, self._device, secret,
                                     pl.secret_file, dict(pl.env), pl.connect_timeout_s)
            self._refs[ref] = p.worker
        self._monitor = threading.Thread(target=self._watch, name="flexpipe-ray-monitor", daemon=True)
        self._monitor.start()

    def describe(self, worker: int) -> str:
        """``host 'node-b' (Ray node 1a2b3c4d, resource 'flexpipe_host_node-b')`` for worker slot ``worker``."""
        p = self.places[worker]
        node = self._where.get(worker, {}).get("ray_node_id")
        where = f", Ray node {node[:8]}" if node else ""
        return f"host {p.host!r}{where}, resource {p.resource!r}"

    def locations(self, timeout_s: float = 30.0) -> list[dict]:
        """Per worker: ``worker``, ``stage``, ``replica``, ``device_id``, ``host``, ``resource``,
        ``ray_node_id``, ``pid`` (the actor's process; asks the actors once, then cached)."""
        ray = self._ray
        missing = [w for w in range(len(self._actors)) if w not in self._where]
        if missing:
            refs = [self._where_refs[w] for w in missing]  # asked at start, before serve() (which blocks the actor)
            for w, info in zip(missing, ray.get(refs, timeout=timeout_s), strict=True):
                self._where[w] = info
        return [{"worker": p.worker, "stage": p.stage, "replica": p.replica, "device_id": p.device_id,
                 "host": p.host, "resource": p.resource, **self._where[p.worker]} for p in self.places]

    def _watch(self) -> None:
        ray = self._ray
        pending = list(self._refs)
        while pending and not self._closed.is_set():
            try:
                done, pending = ray.wait(pending, num_returns=1, timeout=MONITOR_PERIOD_S)
            except Exception:  # the cluster connection went away: FlexPipe's heartbeats still watch
                return
            for ref in done:
                w = self._refs[ref]
                try:
                    code = ray.get(ref, timeout=5)
                except Exception as exc:
                    why = f"{type(exc).__name__}: {first_line(exc)}"
                else:
                    if code == 0:
                        continue
                    why = f"worker exited with code {code}"
                if self._closed.is_set():
                    return
                reason = (f"its Ray actor on {self.describe(w)} ended: {why} (process killed, or its Ray node "
                          f"lost)")
                self.failures[w] = reason
                log.warning("%s: %s", self.places[w].name, reason)
                if self._on_failure is not None:
                    self._on_failure(w, reason)

    def close(self, grace_s: float = 2.0) -> None:
        """Stop watching and kill every actor (their processes end; a worker that already left
        after the head's stop has nothing left to do). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        ray = self._ray
        deadline = time.monotonic() + grace_s
        refs = list(self._refs)
        if refs and grace_s > 0:  # workers end by themselves after a clean stop: give them a moment
            try:
                ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self._monitor is not None:
            self._monitor.join(timeout=2 * MONITOR_PERIOD_S + 1)
