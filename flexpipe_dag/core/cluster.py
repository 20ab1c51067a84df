"""The cluster profile: devices, directed links between them, and when they were measured.

Three YAML/JSON forms load into one validated :class:`ClusterProfile`:

* **native** (what :meth:`ClusterProfile.to_dict` writes): ``cluster_id``, ``devices: [...]``,
  ``links: [{src_device_id, dst_device_id, bandwidth_gbps, latency_us}]``.
* **seed** (the design's original form; one entry per GPU, peers named by ``to_<id>`` keys)::

      nodes:
        - node_id: gpu_001
          generation: A100
          memory_gb: 80
          compute_score: 1.0
          max_batch_microbatch: 32
          interconnect:
            to_gpu_002: {bandwidth_gbps: 300, latency_us: 3}

* **fleet** (compact: GPU models by host, links derived from datasheets)::

      cluster_id: lab
      fleet:
        - {node_id: host-a, gpu_model: A100-SXM-80GB, count: 2}
        - {node_id: host-b, gpu_model: T4, count: 2, available_until: 2026-12-01T06:00:00Z}
      inter_node: {bandwidth_gbps: 12.5, latency_us: 25}

Units: ``memory_gib`` in GiB (datasheet "GB" of HBM is binary), ``bandwidth_gbps`` and
``hbm_bandwidth_gbps`` in GB/s (10^9 bytes per second, as datasheets quote them), ``latency_us`` in
microseconds, ``peak_tflops`` in dense half-precision TFLOP/s. ``compute_score`` is ``peak_tflops``
relative to an A100-SXM-80GB (312 TFLOP/s) = 1.0.

Every loader raises :class:`~flexpipe_dag.core.errors.InputError` naming the file, the field path
(``nodes[2].memory_gb``) and what was expected; nothing is written on bad input.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flexpipe_dag.core.catalog import REFERENCE_MODEL, gpu_catalog, lookup_gpu
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.user_yaml import load_user_yaml

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]

#: How the GPUs of one node talk to each other.
IntraNodeKind = Literal["nvlink", "pcie"]
#: Latency of a link inside one host, by kind, in microseconds (typical NCCL p2p small-message figures).
INTRA_NODE_LATENCY_US: dict[IntraNodeKind, float] = {"nvlink": 3.0, "pcie": 10.0}
REFERENCE_TFLOPS = 312.0
REFERENCE_HBM_GBPS = 2039.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class Device(_Strict):
    """One accelerator (or, on a CPU-only host, one worker process standing in for one)."""

    device_id: str = Field(min_length=1)
    node_id: str = Field(min_length=1, description="host that holds the device")
    model_name: str = "unknown"
    generation: str | None = None
    kind: Literal["cuda", "cpu-worker", "declared"] = "declared"
    memory_gib: PositiveFloat
    peak_tflops: PositiveFloat = Field(description="dense half-precision TFLOP/s (datasheet or measured GEMM)")
    hbm_bandwidth_gbps: PositiveFloat = Field(description="device memory bandwidth, GB/s")
    compute_score: PositiveFloat = Field(description="peak_tflops relative to A100-SXM-80GB = 1.0")
    max_micro_batch: Annotated[int, Field(ge=1)] | None = Field(
        None, description="largest micro_batch_size (sequences) the device takes; the search skips larger ones")
    available_until: dt.datetime | None = None
    op_timings_ms: dict[str, NonNegFloat] = Field(default_factory=dict)
    facts: dict[str, Any] = Field(default_factory=dict, description="raw probe facts (NVML, torch)")

    def usable_memory_gib(self, reserve_fraction: float) -> float:
        """Memory left after keeping ``reserve_fraction`` (0..1) of it in reserve, GiB."""
        return self.memory_gib * (1.0 - reserve_fraction)

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

    src_device_id: str
    dst_device_id: str
    bandwidth_gbps: PositiveFloat = Field(description="GB/s, one direction")
    latency_us: NonNegFloat
    kind: str = "declared"

    def transfer_ms(self, num_bytes: float) -> float:
        """Time to move ``num_bytes`` over this link, ms: latency + bytes / bandwidth."""
        return self.latency_us / 1e3 + num_bytes / (self.bandwidth_gbps * 1e9) * 1e3


class ClusterProfile(_Strict):
    """Devices + directed links + provenance. Validated on construction (see module docstring)."""

    cluster_id: str = Field(min_length=1)
    devices: list[Device] = Field(min_length=1)
    links: list[Link] = Field(default_factory=list)
    measured_at: dt.datetime = Field(default_factory=lambda: dt.datetime.now(dt.UTC))
    source: str = "declared"
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_refs(self) -> ClusterProfile:
        seen: set[str] = set()
        for i, d in enumerate(self.devices):
            if d.device_id in seen:
                raise ValueError(f"devices[{i}].device_id: duplicate device id {d.device_id!r}")
            seen.add(d.device_id)
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
    def device(self, device_id: str) -> Device:
        """The device with this id; ``KeyError`` if absent."""
        for d in self.devices:
            if d.device_id == device_id:
                return d
        raise KeyError(device_id)

    def link(self, src_device_id: str, dst_device_id: str) -> Link | None:
        """The directed link ``src -> dst`` or ``None`` when the profile has none."""
        return self._link_index().get((src_device_id, dst_device_id))

    def _link_index(self) -> dict[tuple[str, str], Link]:
        return {(link.src_device_id, link.dst_device_id): link for link in self.links}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict in the native form (loads back with :func:`parse_cluster_profile`)."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# seed form
class _SeedLink(_Strict):
    bandwidth_gbps: PositiveFloat
    latency_us: NonNegFloat


class _SeedNode(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    node_id: str = Field(min_length=1)
    generation: str | None = None
    model_name: str | None = None
    host: str | None = None
    memory_gb: PositiveFloat
    compute_score: PositiveFloat
    max_batch_microbatch: Annotated[int, Field(ge=1)] | None = None  # the seed file's name for Device.max_micro_batch
    hbm_bandwidth_gbps: PositiveFloat | None = None
    available_until: dt.datetime | None = None
    interconnect: dict[str, _SeedLink] = Field(default_factory=dict)


class _SeedForm(_Strict):
    cluster_id: str = "seed-cluster"
    nodes: list[_SeedNode] = Field(min_length=1)


# fleet form
class _FleetLink(_Strict):
    bandwidth_gbps: PositiveFloat
    latency_us: NonNegFloat


class _FleetNode(_Strict):
    node_id: str = Field(min_length=1)
    gpu_model: str
    count: Annotated[int, Field(ge=1, le=64)] = 1
    intra_node: IntraNodeKind | None = None
    available_until: dt.datetime | None = None


class _FleetForm(_Strict):
    cluster_id: str = Field(min_length=1)
    fleet: list[_FleetNode] = Field(min_length=1)
    inter_node: _FleetLink = _FleetLink(bandwidth_gbps=12.5, latency_us=25.0)
    notes: list[str] = Field(default_factory=list)


def _device_from_spec(device_id: str, node_id: str, generation: str | None, memory_gib: float,
                      compute_score: float | None, hbm_gbps: float | None, **extra: Any) -> Device:
    spec = lookup_gpu(extra.get("model_name") or generation, memory_gib)
    if compute_score is not None:
        peak = compute_score * REFERENCE_TFLOPS
    else:
        peak = spec.peak_tflops if spec else REFERENCE_TFLOPS
    score = peak / REFERENCE_TFLOPS
    if hbm_gbps is None:
        hbm_gbps = spec.hbm_bandwidth_gbps if spec else REFERENCE_HBM_GBPS * score
    model_name = extra.pop("model_name", None) or (spec.model_name if spec else generation or "unknown")
    return Device(device_id=device_id, node_id=node_id, generation=generation, memory_gib=memory_gib,
                  peak_tflops=peak, compute_score=score, hbm_bandwidth_gbps=hbm_gbps,
                  model_name=model_name, **extra)


def _from_seed(form: _SeedForm, source: str) -> ClusterProfile:
    ids = [n.node_id for n in form.nodes]
    for i, node_id in enumerate(ids):
        if node_id in ids[:i]:
            raise InputError(source, f"nodes[{i}].node_id", f"duplicate id {node_id!r}")
    devices, links = [], []
    for i, n in enumerate(form.nodes):
        devices.append(_device_from_spec(
            n.node_id, n.host or n.node_id, n.generation, n.memory_gb, n.compute_score,
            n.hbm_bandwidth_gbps, model_name=n.model_name, max_micro_batch=n.max_batch_microbatch,
            available_until=n.available_until))
        for key, link in n.interconnect.items():
            field = f"nodes[{i}].interconnect.{key}"
            if not key.startswith("to_"):
                raise InputError(source, field, "expected a key of the form to_<node_id>")
            peer = key[3:]
            if peer == n.node_id:
                raise InputError(source, field, f"self-link on {peer!r}")
            if peer not in ids:
                raise InputError(source, field, f"link to unknown node {peer!r}; known: {', '.join(ids)}")
            links.append(Link(src_device_id=n.node_id, dst_device_id=peer, bandwidth_gbps=link.bandwidth_gbps,
                              latency_us=link.latency_us))
    return ClusterProfile(cluster_id=form.cluster_id, devices=devices, links=links, source="declared")


def _from_fleet(form: _FleetForm, source: str) -> ClusterProfile:
    catalog = gpu_catalog()
    devices: list[Device] = []
    intra: dict[str, tuple[IntraNodeKind, float]] = {}
    for i, node in enumerate(form.fleet):
        spec = catalog.get(node.gpu_model)
        if spec is None:
            raise InputError(source, f"fleet[{i}].gpu_model",
                             f"unknown GPU model {node.gpu_model!r}; expected one of {', '.join(catalog)}")
        kind: IntraNodeKind = node.intra_node or ("nvlink" if spec.nvlink_gbps else "pcie")
        if kind == "nvlink" and not spec.nvlink_gbps:
            raise InputError(source, f"fleet[{i}].intra_node", f"{spec.model_name} has no NVLink")
        intra[node.node_id] = (kind, spec.nvlink_gbps if kind == "nvlink" and spec.nvlink_gbps else spec.pcie_gbps)
        for k in range(node.count):
            devices.append(Device(
                device_id=f"{node.node_id}-gpu{k}", node_id=node.node_id, model_name=spec.model_name,
                generation=spec.model_name.split("-")[0], memory_gib=spec.memory_gib,
                peak_tflops=spec.peak_tflops, compute_score=spec.compute_score,
                hbm_bandwidth_gbps=spec.hbm_bandwidth_gbps, available_until=node.available_until))
    node_ids = [n.node_id for n in form.fleet]
    for i, nid in enumerate(node_ids):
        if nid in node_ids[:i]:
            raise InputError(source, f"fleet[{i}].node_id", f"duplicate node id {nid!r}")
    links = []
    for a in devices:
        for b in devices:
            if a is b:
                continue
            if a.node_id == b.node_id:
                intra_kind, bw = intra[a.node_id]
                links.append(Link(src_device_id=a.device_id, dst_device_id=b.device_id, bandwidth_gbps=bw,
                                  latency_us=INTRA_NODE_LATENCY_US[intra_kind], kind=intra_kind))
            else:
                links.append(Link(src_device_id=a.device_id, dst_device_id=b.device_id,
                                  bandwidth_gbps=form.inter_node.bandwidth_gbps,
                                  latency_us=form.inter_node.latency_us, kind="network"))
    return ClusterProfile(cluster_id=form.cluster_id, devices=devices, links=links, source="declared",
                          notes=list(form.notes) + [f"links derived from datasheets; reference {REFERENCE_MODEL}"])


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _input_error(source: str, err: ValidationError) -> InputError:
    first = err.errors()[0]
    field = _loc(first["loc"])
    msg = first["msg"]
    if "input" in first and first["type"] != "missing" and not isinstance(first["input"], dict):
        msg += f" (got {first['input']!r})"
    if first["type"] == "value_error" and ": " in msg:  # our model validators embed the path
        path, _, problem = msg.removeprefix("Value error, ").partition(": ")
        return InputError(source, path, problem)
    more = len(err.errors()) - 1
    return InputError(source, field or None, msg + (f" (and {more} more problem(s))" if more else ""))


def parse_cluster_profile(data: Any, source: str = "<input>") -> ClusterProfile:
    """Validate a parsed YAML/JSON document in any of the three forms.

    Args:
        data: the parsed document (a mapping).
        source: name used in error messages, normally the file path.

    Raises:
        InputError: naming ``source``, the field path and what was expected.
    """
    if not isinstance(data, dict):
        raise InputError(source, None, f"expected a mapping at the top level, got {type(data).__name__}")
    try:
        if "devices" in data:
            return ClusterProfile.model_validate(data)
        if "fleet" in data:
            return _from_fleet(_FleetForm.model_validate(data), source)
        if "nodes" in data:
            return _from_seed(_SeedForm.model_validate(data), source)
    except ValidationError as err:
        raise _input_error(source, err) from None
    raise InputError(source, None, "expected one of the keys 'devices' (native), 'nodes' (seed) or 'fleet'")


def load_cluster_profile(path: str | Path) -> ClusterProfile:
    """Read and validate a cluster profile file (``.yaml``, ``.yml`` or ``.json``).

    Raises:
        InputError: the file is missing, unparsable, or fails validation (file + field named).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(str(path), None, f"cannot read file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError(str(path), None, f"not UTF-8 text ({exc.reason} at byte {exc.start}); expected YAML or JSON") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InputError(str(path), None, f"not valid YAML/JSON: {exc}") from None
    else:
        data = load_user_yaml(text, str(path))
    return parse_cluster_profile(data, str(path))
