"""The cluster profile: devices, directed links between them, and when they were measured.

Three YAML/JSON forms load into one validated :class:`ClusterProfile`:

* **native** (what :meth:`ClusterProfile.to_dict` writes): ``cluster_id``, ``devices: [...]``,
  ``links: [{src_device_id, dst_device_id, bandwidth_gbps, latency_us}]``.
* **seed** (the design's original form; one entry per GPU, peers named by ``to_<id>`` keys)::

      nodes:
        - node_id: gpu-001
          generation: A100
          memory_gb: 80
          compute_score: 1.0          # optional: without it, the datasheet's figures for the generation
          max_batch_microbatch: 32
          interconnect:
            to_gpu_002: {bandwidth_gbps: 300, latency_us: 3}   # names node gpu-002 ('_' for '-')

  ``to_<id>`` names a peer by id; an id written with ``_`` where the node id has ``-`` resolves when
  exactly one node matches (two candidates are an error naming both). A node without
  ``compute_score`` takes the catalog's figures for its ``generation`` (or ``model_name``) and
  ``memory_gb``; one without ``hbm_bandwidth_gbps`` takes the catalog's bandwidth, and only a GPU the
  catalog does not know gets a bandwidth derived from compute (the profile's notes say so).

* **fleet** (compact: GPU models by host, racks and network tiers; a :class:`~flexpipe_dag.core.topology.Topology`
  every pair's link is derived from, nothing stored per pair)::

      cluster_id: lab
      fleet:
        - {node_id: host-a, gpu_model: A100-SXM-80GB, count: 2}
        - {node_id: host-b, gpu_model: T4, count: 2, available_until: 2026-12-01T06:00:00Z}
        - {node_id: t4, gpu_model: T4, count: 4, hosts: 32, hosts_per_rack: 16}
      inter_node: {bandwidth_gbps: 12.5, latency_us: 25}                        # hosts of one rack
      inter_rack: {bandwidth_gbps: 12.5, latency_us: 40, oversubscription: 4}   # across racks
      links:                                                                     # measured pairs: overrides
        - {src_device_id: host-a-gpu0, dst_device_id: host-b-gpu0, bandwidth_gbps: 9.5, latency_us: 31}

  ``count`` is GPUs per host; ``hosts`` (default 1) identical hosts of that shape: host ids are
  ``node_id`` for one host, ``<node_id>-<k>`` (``k`` zero-padded) for several, device ids
  ``<host>-gpu<j>``. ``rack`` puts the entry's hosts in one rack; ``hosts_per_rack`` fills racks
  ``<rack or node_id>-r<j>`` of that many hosts each; hosts with neither share one default rack.
  Inside a host, NVLink when the GPU has it (else PCIe; ``intra_node`` chooses), at the datasheet's
  figure; between hosts of one rack ``inter_node``; across racks ``inter_rack`` (bandwidth divided by
  its oversubscription; default: ``inter_node``).

Memory: ``Device.memory_gib`` is the total the device reports (GiB = 2^30 bytes): the NVML total
when profiled, else the catalog's driver-visible total (a "16 GB" T4 shows 15.0 GiB), not the
datasheet label. The seed form's ``memory_gb`` is that label; ``memory_gib`` there, when given, is the
reported total and wins. The planner plans into :meth:`Device.usable_memory_gib`: the reported total
less :data:`CUDA_CONTEXT_RESERVE_GIB` (GPUs only), less the workload's reserve fraction.

Units: ``memory_gib`` in GiB, ``bandwidth_gbps`` and
``hbm_bandwidth_gbps`` in GB/s (10^9 bytes per second, as datasheets quote them), ``latency_us`` in
microseconds, ``peak_tflops`` in dense half-precision TFLOP/s. ``compute_score`` is ``peak_tflops``
relative to an A100-SXM-80GB (312 TFLOP/s) = 1.0.

Every loader raises :class:`~flexpipe_dag.core.errors.InputError` naming the file, the field path
(``nodes[2].memory_gb``) and what was expected; nothing is written on bad input.

Bounds (what a real fleet stays far inside; anything beyond is a typo or an attack): numbers are
numbers (``memory_gb: yes`` is refused, not read as 1), finite, and at most :data:`MAX_MEMORY_GIB`
GiB of memory per device, :data:`MAX_TFLOPS` TFLOP/s, :data:`MAX_BANDWIDTH_GBPS` GB/s (links and
HBM), :data:`MAX_LATENCY_US` us of link latency; at most :data:`MAX_DEVICES` devices; ids (cluster,
device, host) are :data:`~flexpipe_dag.core.ids.Identifier` s: letters, digits and ``. _ : / @ + -``,
at most 200 characters. Files are read with a size cap (:mod:`flexpipe_dag.core.user_files`).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    StrictBool,
    ValidationError,
    model_validator,
)

from flexpipe_dag.core.catalog import (
    REFERENCE_MODEL,
    GpuSpec,
    gpu_catalog,
    known_generations,
    lookup_gpu,
    visible_gib_from_label,
)
from flexpipe_dag.core.dtypes import canonical_dtype
from flexpipe_dag.core.errors import InputError, shown, validation_input_error
from flexpipe_dag.core.ids import MAX_ID_CHARS, Identifier, PrintableText
from flexpipe_dag.core.topology import (
    MAX_HOSTS,
    FieldsEqual,
    Gbps,
    Host,
    LatencyUs,
    NetworkTier,
    Topology,
)
from flexpipe_dag.core.user_yaml import load_user_document

#: Most memory one device may declare, GiB (16 TiB: above any accelerator, and a large host's RAM for a CPU worker).
MAX_MEMORY_GIB = 16384.0
#: Highest dense half-precision TFLOP/s one device may declare (a B200 is about 2,250).
MAX_TFLOPS = 100_000.0
#: Most devices one cluster profile may hold (links are derived from its topology, never stored per pair).
MAX_DEVICES = 32_768
#: Most explicit links (measured or declared pairs) one profile may hold: every pair of 512 devices.
MAX_LINKS = 512 * 511
#: Largest micro-batch a device may declare, sequences.
MAX_MICRO_BATCH = 65536

# Strict: a boolean (YAML's yes / on) or a string is refused where a number belongs, not converted.
PositiveFloat = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
MemoryGib = Annotated[float, Strict(), Field(gt=0, le=MAX_MEMORY_GIB, allow_inf_nan=False)]
Tflops = Annotated[float, Strict(), Field(gt=0, le=MAX_TFLOPS, allow_inf_nan=False)]
Score = Annotated[float, Strict(), Field(gt=0, le=MAX_TFLOPS / 312.0, allow_inf_nan=False)]
MicroBatch = Annotated[int, Strict(), Field(ge=1, le=MAX_MICRO_BATCH)]


def _date_time_not_a_number(value: Any) -> Any:
    """``available_until`` is a date-time: a number (pydantic would read it as seconds since 1970) is refused."""
    if isinstance(value, (int, float)):  # booleans too
        kind = "boolean" if isinstance(value, bool) else "number"
        raise ValueError(f"got the {kind} {shown(value)}; expected an ISO 8601 date-time such as 2026-12-01T06:00:00Z")
    return value


#: When a device stops being available: an ISO 8601 date-time (YAML's unquoted timestamp or a string;
#: no time zone = UTC), never a number.
AvailableUntil = Annotated[dt.datetime, BeforeValidator(_date_time_not_a_number)]
#: A fleet node's id leaves room for the ``-gpu<k>`` suffix its device ids take.
FleetNodeId = Annotated[Identifier, Field(max_length=MAX_ID_CHARS - 8)]

#: How the GPUs of one node talk to each other.
IntraNodeKind = Literal["nvlink", "pcie"]
#: Latency of a link inside one host, by kind, in microseconds (typical NCCL p2p small-message figures).
INTRA_NODE_LATENCY_US: dict[IntraNodeKind, float] = {"nvlink": 3.0, "pcie": 10.0}
REFERENCE_TFLOPS = 312.0
REFERENCE_HBM_GBPS = 2039.0
#: Device memory a serving process holds outside its tensors on each GPU, GiB: the CUDA context,
#: cuBLAS / NCCL workspaces and the allocator's slack. PyTorch: "some context needs to be created on
#: GPU" (torch.cuda.memory_allocated docs, "Memory management"); nvidia-smi shows ~300-800 MiB in use by
#: a Python ML process before its first tensor (e.g. pytorch/pytorch#34323: 781 MB). 0.5 GiB is the
#: typical figure; the workload's 10-15 % reserve fraction covers the rest.
CUDA_CONTEXT_RESERVE_GIB = 0.5
#: What planning does when a gear's dtype is bf16 and some usable devices have no bf16 (compute
#: capability < 8.0): ``fp16`` plans the whole gear in fp16 (vLLM's ``--dtype auto`` does the same and
#: warns), ``exclude`` leaves those devices out, ``refuse`` raises (vLLM's explicit ``--dtype bfloat16``).
Bf16Fallback = Literal["fp16", "exclude", "refuse"]
BF16_FALLBACKS: tuple[str, ...] = ("fp16", "exclude", "refuse")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class Device(_Strict):
    """One accelerator (or, on a CPU-only host, one worker process standing in for one)."""

    device_id: Identifier
    node_id: Identifier = Field(description="host that holds the device")
    model_name: PrintableText = Field("unknown", max_length=MAX_ID_CHARS)
    generation: PrintableText | None = Field(None, max_length=100)
    kind: Literal["cuda", "cpu-worker", "declared"] = "declared"
    memory_gib: MemoryGib = Field(
        description="device memory total the device reports, GiB (NVML when profiled, else the catalog's "
                    "driver-visible total; not the datasheet label)")
    peak_tflops: Tflops = Field(description="dense half-precision TFLOP/s (datasheet or measured GEMM)")
    hbm_bandwidth_gbps: Gbps = Field(description="device memory bandwidth, GB/s")
    compute_score: Score = Field(description="peak_tflops relative to A100-SXM-80GB = 1.0")
    max_micro_batch: MicroBatch | None = Field(
        None, description="largest micro_batch_size (sequences) the device takes; the search skips larger ones")
    available_until: AvailableUntil | None = None
    bf16: StrictBool | None = Field(
        None, description="whether the device computes in bfloat16 (compute capability >= 8.0): from the catalog, "
                          "or torch.cuda.is_bf16_supported() when profiled; None = not known (planned as able)")
    op_timings_ms: dict[str, NonNegFloat] = Field(default_factory=dict)
    facts: dict[str, Any] = Field(default_factory=dict, description="raw probe facts (NVML, torch)")

    @property
    def context_reserve_gib(self) -> float:
        """Memory the runtime holds outside tensors, GiB: :data:`CUDA_CONTEXT_RESERVE_GIB` on a GPU, 0 on a CPU worker."""
        return 0.0 if self.kind == "cpu-worker" else CUDA_CONTEXT_RESERVE_GIB

    def usable_memory_gib(self, reserve_fraction: float) -> float:
        """Memory a plan may fill on this device, GiB: the one rule the planner and its checks use.

        ``(memory_gib - context_reserve_gib) x (1 - reserve_fraction)``, never below 0, with
        ``memory_gib`` the reported total (NVML when profiled, else the catalog's driver-visible total)
        and ``reserve_fraction`` (0..1) the workload's headroom.
        """
        return max(self.memory_gib - self.context_reserve_gib, 0.0) * (1.0 - reserve_fraction)

    @property
    def lacks_bf16(self) -> bool:
        """True only when the device is known to have no bfloat16 math (``bf16 is False``)."""
        return self.bf16 is False

    def available_for_s(self, now: dt.datetime) -> float:
        """Seconds from ``now`` until the device stops being available (``inf`` if it never does)."""
        if self.available_until is None:
            return math.inf
        until = self.available_until
        if until.tzinfo is None:
            until = until.replace(tzinfo=dt.UTC)
        if now.tzinfo is None:
            now = now.replace(tzinfo=dt.UTC)
        return (until - now).total_seconds()


class Link(_Strict):
    """A measured (or declared) directed path between two devices."""

    src_device_id: Identifier
    dst_device_id: Identifier
    bandwidth_gbps: Gbps = Field(description="GB/s, one direction")
    latency_us: LatencyUs
    kind: PrintableText = Field("declared", max_length=40)

    def transfer_ms(self, num_bytes: float) -> float:
        """Time to move ``num_bytes`` over this link, ms: latency + bytes / bandwidth."""
        return self.latency_us / 1e3 + num_bytes / (self.bandwidth_gbps * 1e9) * 1e3


class ClusterProfile(_Strict, FieldsEqual):
    """Devices + their network + provenance. Validated on construction (see module docstring).

    The link between two devices (:meth:`link`) is the explicit one in ``links`` when there is one
    (measured or declared pairs: overrides), else the one ``topology`` derives from the two devices'
    hosts (:mod:`flexpipe_dag.core.topology`), else none. A profile with a topology stores hosts and
    tiers, linear in devices; ``links`` then holds only the pairs measured apart from it.
    """

    cluster_id: Identifier
    devices: list[Device] = Field(min_length=1, max_length=MAX_DEVICES)
    links: list[Link] = Field(default_factory=list, max_length=MAX_LINKS,
                              description="explicit pairs; with a topology, overrides of its derived figures")
    topology: Topology | None = Field(None, description="hosts and network tiers every pair is derived from")
    measured_at: dt.datetime = Field(default_factory=lambda: dt.datetime.now(dt.UTC))
    source: PrintableText = Field("declared", max_length=40)
    notes: list[PrintableText] = Field(default_factory=list)
    # lookups built on first use, rebuilt when a field they index is replaced (identity and length checked)
    _index: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_refs(self) -> ClusterProfile:
        seen: set[str] = set()
        for i, d in enumerate(self.devices):
            if d.device_id in seen:
                raise ValueError(f"devices[{i}].device_id: duplicate device id {d.device_id!r}")
            seen.add(d.device_id)
        if self.topology is not None:
            host_ids = {h.host_id for h in self.topology.hosts}
            for i, d in enumerate(self.devices):
                if d.node_id not in host_ids:
                    raise ValueError(f"devices[{i}].node_id: host {d.node_id!r} is not in topology.hosts; expected "
                                     f"one of the {len(self.topology.hosts)} hosts named there")
        pairs: set[tuple[str, str]] = set()
        for i, link in enumerate(self.links):
            for end in ("src_device_id", "dst_device_id"):
                if getattr(link, end) not in seen:
                    raise ValueError(f"links[{i}].{end}: unknown device {getattr(link, end)!r}")
            if link.src_device_id == link.dst_device_id:
                raise ValueError(f"links[{i}]: self-link on {link.src_device_id!r}")
            pair = (link.src_device_id, link.dst_device_id)
            if pair in pairs:
                raise ValueError(f"links[{i}]: duplicate link {pair[0]} -> {pair[1]}")
            pairs.add(pair)
        return self

    # -- lookups -------------------------------------------------------------------------------
    def _indexed(self, name: str, values: list[Any], build: Any) -> Any:
        hit = self._index.get(name)
        if hit is None or hit[0] is not values or hit[1] != len(values):
            hit = (values, len(values), build(values))
            self._index[name] = hit
        return hit[2]

    def device(self, device_id: str) -> Device:
        """The device with this id; ``KeyError`` if absent."""
        by_id: dict[str, Device] = self._indexed("devices", self.devices,
                                                 lambda ds: {d.device_id: d for d in ds})
        return by_id[device_id]

    def explicit_link(self, src_device_id: str, dst_device_id: str) -> Link | None:
        """The pair ``src -> dst`` as ``links`` holds it (measured or declared), or ``None``."""
        by_pair: dict[tuple[str, str], Link] = self._indexed(
            "links", self.links, lambda ls: {(lk.src_device_id, lk.dst_device_id): lk for lk in ls})
        return by_pair.get((src_device_id, dst_device_id))

    def link(self, src_device_id: str, dst_device_id: str) -> Link | None:
        """The directed link ``src -> dst``: the explicit one (an override) when ``links`` has it, else
        the one the topology derives from the devices' hosts, else ``None`` (the pair cannot be adjacent).

        Figures in GB/s (``bandwidth_gbps``, one direction) and microseconds (``latency_us``).
        """
        explicit = self.explicit_link(src_device_id, dst_device_id)
        if explicit is not None or self.topology is None or src_device_id == dst_device_id:
            return explicit
        try:
            src, dst = self.device(src_device_id), self.device(dst_device_id)
        except KeyError:
            return None
        bandwidth_gbps, latency_us, kind = self.topology.pair_figures(src.node_id, dst.node_id)
        # figures come from validated hosts and tiers: no second validation per pair
        return Link.model_construct(src_device_id=src_device_id, dst_device_id=dst_device_id,
                                    bandwidth_gbps=bandwidth_gbps, latency_us=latency_us, kind=kind)

    def link_is_overridden(self, device_id: str) -> bool:
        """Whether ``links`` holds an explicit pair from or to ``device_id`` (its figures are its own)."""
        ends: set[str] = self._indexed("link_ends", self.links,
                                       lambda ls: {e for lk in ls for e in (lk.src_device_id, lk.dst_device_id)})
        return device_id in ends

    def min_bandwidth_gbps(self) -> float | None:
        """The lowest bandwidth any linked pair of devices has, GB/s (explicit pairs and the topology's
        tiers and hosts); ``None`` when no pair is linked."""
        figures = [lk.bandwidth_gbps for lk in self.links]
        if self.topology is not None and len(self.devices) > 1:
            used = {d.node_id for d in self.devices}
            if len(used) > 1:
                figures += [t.effective_bandwidth_gbps for t in self.topology.tiers()]
            figures += [h.intra_bandwidth_gbps for h in self.topology.hosts if h.host_id in used]
        return min(figures, default=None)

    def restricted(self, device_ids: set[str], cluster_id: str | None = None) -> ClusterProfile:
        """The profile cut down to ``device_ids``: their explicit links and their hosts kept, tiers kept.

        Raises:
            ValueError: ``device_ids`` holds no device of the profile.
        """
        devices = [d for d in self.devices if d.device_id in device_ids]
        if not devices:
            raise ValueError(f"none of {sorted(device_ids)[:5]} is a device of {self.cluster_id!r}")
        topology = (self.topology.subset({d.node_id for d in devices}) if self.topology is not None else None)
        return self.model_copy(update={
            "cluster_id": cluster_id or self.cluster_id, "devices": devices, "topology": topology,
            "links": [lk for lk in self.links if lk.src_device_id in device_ids and lk.dst_device_id in device_ids]})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict in the native form (loads back with :func:`parse_cluster_profile`)."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# seed form
class _SeedLink(_Strict):
    bandwidth_gbps: Gbps
    latency_us: LatencyUs


class _SeedNode(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    node_id: Identifier
    generation: PrintableText | None = Field(None, max_length=100)
    model_name: PrintableText | None = Field(None, max_length=MAX_ID_CHARS)
    host: Identifier | None = None
    memory_gb: MemoryGib = Field(description="datasheet label, GB (e.g. 16 for a T4)")
    memory_gib: MemoryGib | None = Field(None, description="the total the device reports (nvidia-smi), GiB")
    compute_score: Score | None = None
    bf16: StrictBool | None = None
    max_batch_microbatch: MicroBatch | None = None  # the seed file's name for Device.max_micro_batch
    hbm_bandwidth_gbps: Gbps | None = None
    available_until: AvailableUntil | None = None
    interconnect: dict[str, _SeedLink] = Field(default_factory=dict)


class _SeedForm(_Strict):
    cluster_id: Identifier = "seed-cluster"
    nodes: list[_SeedNode] = Field(min_length=1, max_length=MAX_DEVICES)


# fleet form
class _FleetNode(_Strict):
    node_id: FleetNodeId
    gpu_model: str = Field(max_length=MAX_ID_CHARS)
    count: Annotated[int, Strict(), Field(ge=1, le=64)] = 1
    hosts: Annotated[int, Strict(), Field(ge=1, le=MAX_HOSTS)] = 1
    rack: Identifier | None = None
    hosts_per_rack: Annotated[int, Strict(), Field(ge=1, le=MAX_HOSTS)] | None = None
    intra_node: IntraNodeKind | None = None
    available_until: AvailableUntil | None = None


class _FleetForm(_Strict):
    cluster_id: Identifier
    fleet: list[_FleetNode] = Field(min_length=1, max_length=MAX_HOSTS)
    inter_node: NetworkTier = NetworkTier(bandwidth_gbps=12.5, latency_us=25.0)
    inter_rack: NetworkTier | None = None
    links: list[Link] = Field(default_factory=list, max_length=MAX_LINKS)
    notes: list[PrintableText] = Field(default_factory=list)


def _resolve_peer(key: str, ids: list[str], own: str, source: str, field: str) -> str:
    """The node id a seed ``to_<id>`` key names (``to_gpu_002`` -> ``gpu-002``); InputError when none or two match."""
    if not key.startswith("to_"):
        raise InputError(source, field, f"expected a key of the form to_<node_id>, got {shown(key)}")
    written = key[3:]
    # an exact match does not win silently: gpu_002 and gpu-002 both answer to to_gpu_002
    candidates = [i for i in ids if i.replace("-", "_") == written.replace("-", "_")]
    if len(candidates) > 1:
        raise InputError(source, field, f"{shown(key)} is ambiguous: it could name node {candidates[0]!r} or node "
                                        f"{candidates[1]!r} ('_' read as '-'); rename one of them")
    if not candidates:
        raise InputError(source, field, f"link to unknown node {shown(written)}; known: {', '.join(ids)}")
    peer = candidates[0]
    if peer == own:
        raise InputError(source, field, f"self-link on {peer!r}")
    return peer


def _seed_device(n: _SeedNode, i: int, source: str, notes: list[str]) -> Device:
    """One seed node as a :class:`Device`: declared figures first, then the catalog, then derivations (noted)."""
    where = f"nodes[{i}]"
    name = n.model_name or n.generation
    label = n.memory_gb
    spec: GpuSpec | None = lookup_gpu(name, label)
    if n.compute_score is None and spec is None:
        # the name looked up is model_name when given, else generation: the field named is the one that was read
        field = f"{where}.model_name" if n.model_name else f"{where}.generation"
        what = f"GPU {name!r} is not in the datasheet catalog" if name else "neither generation nor model_name is given"
        raise InputError(source, field,
                         f"no compute_score and {what}; give compute_score (A100-SXM-80GB = 1.0) and "
                         f"hbm_bandwidth_gbps, or a generation it knows: {', '.join(known_generations())}")
    # memory: the reported total if given; else the catalog's driver-visible total for that label; else derived
    if n.memory_gib is not None:
        memory_gib = n.memory_gib
    elif spec is not None and abs(spec.memory_label_gb - label) < 0.5:
        memory_gib = spec.memory_gib
    else:
        memory_gib = visible_gib_from_label(label)
        notes.append(f"{where} ({n.node_id}): memory_gb {label:g} taken as {memory_gib:.2f} GiB driver-visible "
                     f"(label x {memory_gib / label:.4f}; the catalog has no {name or 'such'} GPU with that label); "
                     f"give memory_gib (nvidia-smi's total) to use the reported figure")
    if n.compute_score is not None:
        peak = n.compute_score * REFERENCE_TFLOPS
    else:
        assert spec is not None
        peak = spec.peak_tflops
    score = peak / REFERENCE_TFLOPS
    hbm_gbps = n.hbm_bandwidth_gbps
    if hbm_gbps is None:
        if spec is not None:
            hbm_gbps = spec.hbm_bandwidth_gbps
        else:
            hbm_gbps = REFERENCE_HBM_GBPS * score
            which = f"GPU {name!r} not in the catalog" if name else "no generation or model_name given"
            notes.append(f"{where} ({n.node_id}): hbm_bandwidth_gbps derived from compute_score as {hbm_gbps:.0f} GB/s "
                         f"({which}); give hbm_bandwidth_gbps from its datasheet")
    bf16 = n.bf16 if n.bf16 is not None else (spec.bf16 if spec is not None else None)
    model_name = n.model_name or (spec.model_name if spec else n.generation or "unknown")
    return Device(device_id=n.node_id, node_id=n.host or n.node_id, generation=n.generation, memory_gib=memory_gib,
                  peak_tflops=peak, compute_score=score, hbm_bandwidth_gbps=hbm_gbps, model_name=model_name,
                  bf16=bf16, max_micro_batch=n.max_batch_microbatch, available_until=n.available_until)


def _from_seed(form: _SeedForm, source: str) -> ClusterProfile:
    ids = [n.node_id for n in form.nodes]
    for i, node_id in enumerate(ids):
        if node_id in ids[:i]:
            raise InputError(source, f"nodes[{i}].node_id", f"duplicate id {node_id!r}")
    devices: list[Device] = []
    links: list[Link] = []
    notes: list[str] = []
    for i, n in enumerate(form.nodes):
        devices.append(_seed_device(n, i, source, notes))
        for key, link in n.interconnect.items():
            peer = _resolve_peer(key, ids, n.node_id, source, f"nodes[{i}].interconnect.{key}")
            links.append(Link(src_device_id=n.node_id, dst_device_id=peer, bandwidth_gbps=link.bandwidth_gbps,
                              latency_us=link.latency_us))
    return ClusterProfile(cluster_id=form.cluster_id, devices=devices, links=links, source="declared", notes=notes)


def _fleet_host_ids(node: _FleetNode, i: int, source: str) -> list[tuple[str, str | None]]:
    """``(host_id, rack_id)`` of each host of one fleet entry (ids in the module docstring)."""
    if node.hosts_per_rack is not None and node.hosts_per_rack > node.hosts:
        raise InputError(source, f"fleet[{i}].hosts_per_rack",
                         f"{node.hosts_per_rack} hosts per rack for {node.hosts} host(s); expected at most hosts")
    width = len(str(node.hosts - 1))
    suffix_chars = (1 + width if node.hosts > 1 else 0) + len(f"-gpu{node.count - 1}")
    if len(node.node_id) + suffix_chars > MAX_ID_CHARS:
        raise InputError(source, f"fleet[{i}].node_id", f"{len(node.node_id)} characters leave no room for the "
                                                         f"host and GPU suffixes; expected at most "
                                                         f"{MAX_ID_CHARS - suffix_chars}")
    out: list[tuple[str, str | None]] = []
    for k in range(node.hosts):
        host_id = node.node_id if node.hosts == 1 else f"{node.node_id}-{k:0{width}d}"
        rack = node.rack
        if node.hosts_per_rack is not None:
            racks = -(-node.hosts // node.hosts_per_rack)
            rack = f"{node.rack or node.node_id}-r{k // node.hosts_per_rack:0{len(str(racks - 1))}d}"
            if len(rack) > MAX_ID_CHARS:
                raise InputError(source, f"fleet[{i}].rack", f"rack ids of {len(rack)} characters; expected at most "
                                                              f"{MAX_ID_CHARS}")
        out.append((host_id, rack))
    return out


def _from_fleet(form: _FleetForm, source: str) -> ClusterProfile:
    total = sum(node.count * node.hosts for node in form.fleet)
    if total > MAX_DEVICES:
        raise InputError(source, "fleet", f"{total} devices; expected at most {MAX_DEVICES} in one cluster profile")
    catalog = gpu_catalog()
    devices: list[Device] = []
    hosts: list[Host] = []
    seen_hosts: dict[str, int] = {}
    # one validated device per GPU model and availability; its copies differ only in ids built from validated parts
    templates: dict[tuple[str, dt.datetime | None], Device] = {}
    for i, node in enumerate(form.fleet):
        spec = catalog.get(node.gpu_model)
        if spec is None:
            raise InputError(source, f"fleet[{i}].gpu_model",
                             f"unknown GPU model {shown(node.gpu_model)}; expected one of {', '.join(catalog)}")
        kind: IntraNodeKind = node.intra_node or ("nvlink" if spec.nvlink_gbps else "pcie")
        if kind == "nvlink" and not spec.nvlink_gbps:
            raise InputError(source, f"fleet[{i}].intra_node", f"{spec.model_name} has no NVLink")
        intra_gbps = spec.nvlink_gbps if kind == "nvlink" and spec.nvlink_gbps else spec.pcie_gbps
        host_ids = _fleet_host_ids(node, i, source)
        template = templates.get((spec.model_name, node.available_until))
        if template is None:
            template = templates[(spec.model_name, node.available_until)] = Device(
                device_id=f"{host_ids[0][0]}-gpu0", node_id=host_ids[0][0], model_name=spec.model_name,
                generation=spec.generation, memory_gib=spec.memory_gib, peak_tflops=spec.peak_tflops,
                compute_score=spec.compute_score, hbm_bandwidth_gbps=spec.hbm_bandwidth_gbps, bf16=spec.bf16,
                available_until=node.available_until)
        for host_id, rack_id in host_ids:
            if host_id in seen_hosts:
                raise InputError(source, f"fleet[{i}].node_id", f"duplicate host id {host_id!r} (also made by "
                                                                 f"fleet[{seen_hosts[host_id]}])")
            seen_hosts[host_id] = i
            hosts.append(Host.model_construct(host_id=host_id, rack_id=rack_id, intra_kind=kind,
                                              intra_bandwidth_gbps=intra_gbps,
                                              intra_latency_us=INTRA_NODE_LATENCY_US[kind]))
            devices.extend(template.model_copy(update={"device_id": f"{host_id}-gpu{k}", "node_id": host_id})
                           for k in range(node.count))
    topology = Topology(hosts=hosts, inter_node=form.inter_node, inter_rack=form.inter_rack)
    return ClusterProfile(cluster_id=form.cluster_id, devices=devices, links=form.links, topology=topology,
                          source="declared",
                          notes=list(form.notes) + [f"links derived from datasheets and the topology; reference "
                                                    f"{REFERENCE_MODEL}"])


def parse_cluster_profile(data: Any, source: str = "<input>") -> ClusterProfile:
    """Validate a parsed YAML/JSON document in any of the three forms.

    Args:
        data: the parsed document (a mapping).
        source: name used in error messages, normally the file path.

    Raises:
        InputError: naming ``source``, the field path and what was expected.
    """
    if data is None:  # an empty file, or one holding only comments
        raise InputError(source, None, "the file holds no document; expected a mapping with 'devices', 'nodes' or "
                                       "'fleet' at the top level")
    if not isinstance(data, dict):
        raise InputError(source, None, f"expected a mapping at the top level, got {type(data).__name__}")
    forms = [key for key in ("devices", "nodes", "fleet") if key in data]
    if len(forms) > 1:
        raise InputError(source, None, f"holds {' and '.join(repr(k) for k in forms)}; expected one form of profile: "
                                       "'devices' (native), 'nodes' (seed) or 'fleet' (fleet)")
    try:
        if "devices" in data:
            return ClusterProfile.model_validate(data)
        if "fleet" in data:
            return _from_fleet(_FleetForm.model_validate(data), source)
        if "nodes" in data:
            return _from_seed(_SeedForm.model_validate(data), source)
    except ValidationError as err:
        raise validation_input_error(source, err) from None
    raise InputError(source, None, "expected one of the keys 'devices' (native), 'nodes' (seed) or 'fleet'")


def load_cluster_profile(path: str | Path) -> ClusterProfile:
    """Read and validate a cluster profile file (``.yaml``, ``.yml`` or ``.json``).

    Raises:
        InputError: the file is missing, not a regular file, over its size cap (JSON
            :data:`~flexpipe_dag.core.user_files.MAX_JSON_BYTES`, YAML
            :data:`~flexpipe_dag.core.user_files.MAX_YAML_BYTES`), not UTF-8, unparsable, or fails
            validation (file + field named).
    """
    data = load_user_document(path, "cluster profile")
    return parse_cluster_profile(data, str(path))


# ---------------------------------------------------------------------------------------------
# dtype support
@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a gear runs in on a set of devices, and what was done to get there.

    Attributes:
        dtype: canonical dtype every stage of the gear computes in (a gear runs in one dtype).
        excluded_device_ids: devices left out because they cannot run the requested dtype.
        note: one sentence saying what changed and why (``None`` when nothing did).
    """

    dtype: str
    excluded_device_ids: tuple[str, ...] = ()
    note: str | None = None


#: Most devices a message names one by one; more are counted by GPU model.
LISTED_DEVICES_MAX = 8


def _listed(devices: Sequence[Device]) -> str:
    """``id (model), ...`` for a few devices; ``N x model (first id, ...)`` per model for many."""
    if len(devices) <= LISTED_DEVICES_MAX:
        return ", ".join(f"{d.device_id} ({d.model_name})" for d in devices)
    by_model: dict[str, list[str]] = {}
    for d in devices:
        by_model.setdefault(d.model_name, []).append(d.device_id)
    return ", ".join(f"{len(ids)} x {model} ({ids[0]} ...)" for model, ids in by_model.items())


def choose_gear_dtype(devices: Sequence[Device], dtype: str, fallback: str = "fp16",
                      source: str = "planning") -> DtypeChoice:
    """Decide the dtype of a gear planned on ``devices`` (the usable ones) when ``dtype`` is requested.

    A gear runs in one dtype. When ``dtype`` is bf16 and some devices are known to lack it
    (``Device.bf16 is False``: V100, T4, P100, compute capability < 8.0), ``fallback`` decides:

    * ``"fp16"`` (default): a gear using such a device runs in fp16 on all its devices (vLLM's ``--dtype
      auto`` does this and warns); the planner keeps bf16 for a gear on bf16 devices only
      (:func:`~flexpipe_dag.planner.gears.gear_plan_dtype`);
    * ``"exclude"``: those devices are left out and the gear stays bf16;
    * ``"refuse"``: :class:`InputError` (vLLM's explicit ``--dtype bfloat16`` refuses the same way).

    Every outcome other than "no change" carries a note listing the devices.

    Raises:
        InputError: unknown dtype or ``fallback``; ``"refuse"`` with devices lacking bf16; ``"exclude"``
            leaving no device.
    """
    dtype = canonical_dtype(dtype, source, "dtype")
    if fallback not in BF16_FALLBACKS:
        raise InputError(source, "bf16_fallback", f"expected one of {', '.join(BF16_FALLBACKS)}, got {fallback!r}")
    lacking = [d for d in devices if d.lacks_bf16]
    if dtype != "bf16" or not lacking:
        return DtypeChoice(dtype)
    listed = _listed(lacking)
    if fallback == "refuse":
        raise InputError(source, "dtype", f"bf16 is not supported on {len(lacking)} device(s): {listed} (compute "
                                          f"capability < 8.0); plan with dtype fp16, or set bf16_fallback to 'fp16' "
                                          f"(whole gear in fp16) or 'exclude' (leave those devices out)")
    if fallback == "exclude":
        if len(lacking) == len(devices):
            raise InputError(source, "dtype", f"bf16 is not supported on any usable device ({listed}); plan with "
                                              f"dtype fp16 or bf16_fallback 'fp16'")
        return DtypeChoice("bf16", tuple(d.device_id for d in lacking),
                           f"bf16 requested: left out {len(lacking)} device(s) without bf16: {listed}")
    return DtypeChoice("fp16", (), f"bf16 requested but {len(lacking)} device(s) have no bf16: {listed}; "
                                   f"a gear using any of them runs in fp16 on all its devices, a gear on bf16 "
                                   f"devices only stays bf16 (bf16_fallback 'fp16')")
