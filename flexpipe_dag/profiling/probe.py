"""Measure a host's devices and the links between them, for real, and build a ClusterProfile.

One process per device is spawned (``torch.multiprocessing``), joined in a ``torch.distributed``
group (NCCL on GPUs, gloo on CPU). Each process runs the microbenchmarks of
:mod:`flexpipe_dag.profiling.microbench` on its own device, then every ordered pair of processes measures
send/recv latency (ping-pong of a 4-byte message, half the median round trip) and bandwidth (a large
message, its time less the latency). On a host without GPUs the same code measures CPU worker
processes as devices (each with ``cores / workers`` threads and ``RAM / workers`` memory) and says
so in the profile's notes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexpipe_dag.core.cluster import REFERENCE_TFLOPS, ClusterProfile, Device, Link
from flexpipe_dag.core.errors import one_line
from flexpipe_dag.core.host import cpu_worker_device_id, host_memory_bytes
from flexpipe_dag.core.topology import Host
from flexpipe_dag.profiling.microbench import (
    DEFAULT_LAYER,
    LayerShape,
    gemm_tflops,
    layer_times_ms,
    max_micro_batch,
    memory_bandwidth_gbps,
)
from flexpipe_dag.profiling.nvml_facts import read_nvml_facts

if TYPE_CHECKING:
    import torch


@dataclass
class ProbeSettings:
    """What the probe measures and how hard (defaults finish in ~10-20 s on a 2-core CPU host)."""

    num_cpu_workers: int = 2
    layer: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LAYER))
    token_counts: list[int] = field(default_factory=lambda: [16, 128, 512])
    context_tokens: int = 512
    gemm_n_cpu: int = 512
    gemm_n_cuda: int = 8192
    copy_bytes_cpu: int = 64 * 2**20
    copy_bytes_cuda: int = 2 * 2**30
    link_bytes_cpu: int = 16 * 2**20
    link_bytes_cuda: int = 512 * 2**20
    link_repeats: int = 5


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _measure_links(rank: int, world: int, device: torch.device, nbytes: int,
                   repeats: int) -> dict[int, dict[str, float]]:
    """Ordered-pair latency (us) and bandwidth (GB/s) from ``rank`` to every peer (run on all ranks)."""
    import torch
    import torch.distributed as dist

    small = torch.zeros(1, device=device)
    big = torch.zeros(nbytes // 4, device=device)
    out: dict[int, dict[str, float]] = {}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            if rank in (src, dst):
                peer = dst if rank == src else src
                rtts, sends = [], []
                for i in range(repeats + 1):  # first round warms the connection up
                    sync()
                    t0 = time.perf_counter()
                    if rank == src:
                        dist.send(small, peer)
                        dist.recv(small, peer)
                    else:
                        dist.recv(small, peer)
                        dist.send(small, peer)
                    sync()
                    rtt = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    if rank == src:
                        dist.send(big, peer)
                        dist.recv(small, peer)  # ack: the receiver has the whole message
                    else:
                        dist.recv(big, peer)
                        dist.send(small, peer)
                    sync()
                    if i:
                        rtts.append(rtt)
                        sends.append(time.perf_counter() - t0)
                if rank == src:
                    rtt_s = statistics.median(rtts)
                    payload_s = max(statistics.median(sends) - rtt_s, 1e-9)
                    out[dst] = {"latency_us": rtt_s / 2 * 1e6, "bandwidth_gbps": nbytes / payload_s / 1e9}
            dist.barrier()
    return out


def _worker(rank: int, world: int, port: int, secret: str, out_dir: str, settings: dict[str, Any],
            use_cuda: bool) -> None:
    """Body of one probe process: microbenchmarks on its device, then link measurements (the ranks
    rendezvous through the parent's authenticated control store on 127.0.0.1:``port``)."""
    import torch
    import torch.distributed as dist

    from flexpipe_dag.runtime.rendezvous import keep_backend_on_loopback, process_group_store

    s = ProbeSettings(**settings)
    if use_cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dtype = torch.float32
        backend = "gloo"
    shape = LayerShape(**s.layer)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"rank": rank, "dtype": str(dtype).removeprefix("torch.")}
    result["bf16"] = bool(torch.cuda.is_bf16_supported()) if use_cuda else True
    result["gemm_tflops"] = gemm_tflops(device, dtype, s.gemm_n_cuda if use_cuda else s.gemm_n_cpu)
    result["memory_bandwidth_gbps"] = memory_bandwidth_gbps(device, s.copy_bytes_cuda if use_cuda else s.copy_bytes_cpu)
    result["op_timings_ms"] = layer_times_ms(device, dtype, shape, s.token_counts)
    if use_cuda:
        free, total = torch.cuda.mem_get_info(device)
        budget, result["memory_gib"] = free, total / 2**30
    else:
        total = host_memory_bytes() // world
        budget, result["memory_gib"] = total // 2, total / 2**30
    result["max_micro_batch"], result["max_micro_batch_method"] = max_micro_batch(
        device, dtype, shape, s.context_tokens, budget)
    if use_cuda:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        import resource

        result["peak_memory_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    result["microbench_s"] = time.perf_counter() - t0
    keep_backend_on_loopback()  # every probe rank runs on this host
    store = process_group_store("127.0.0.1", port, 120.0, secret)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=120))
    try:
        result["links"] = _measure_links(rank, world, device, s.link_bytes_cuda if use_cuda else s.link_bytes_cpu,
                                         s.link_repeats)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def probe_host(cluster_id: str | None = None, settings: ProbeSettings | None = None) -> ClusterProfile:
    """Measure this host's GPUs (or CPU worker processes when it has none) and return their profile.

    Raises:
        RuntimeError: a probe process failed (its traceback is chained).
    """
    import torch
    import torch.multiprocessing as mp

    settings = settings or ProbeSettings()
    host = socket.gethostname()
    nvml = read_nvml_facts()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    world = torch.cuda.device_count() if use_cuda else settings.num_cpu_workers
    notes = [one_line(f"pynvml: {e}") for e in nvml.errors]  # a profile's notes are printable text
    if not use_cuda:
        notes.append(f"no CUDA device: measured {world} CPU worker processes as devices "
                     f"({max(1, (os.cpu_count() or 1) // world)} threads each, fp32)")
    from flexpipe_dag.runtime.control_auth import new_secret
    from flexpipe_dag.runtime.control_store import ControlStoreServer

    secret = new_secret()
    # loopback only, on the kernel's port (no race), and only ranks holding the secret join
    control = ControlStoreServer("127.0.0.1", 0, secret)
    try:
        with tempfile.TemporaryDirectory(prefix="flexpipe-probe-") as out_dir:
            mp.start_processes(  # type: ignore[no-untyped-call]  # torch leaves start_processes unannotated
                _worker, args=(world, control.port, secret, out_dir, asdict(settings), use_cuda), nprocs=world,
                join=True, start_method="spawn")
            ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        control.close()
    devices, links = [], []
    for r in ranks:
        facts = {k: r[k] for k in ("dtype", "gemm_tflops", "memory_bandwidth_gbps", "peak_memory_gib",
                                   "max_micro_batch_method", "microbench_s")}
        memory_gib = r["memory_gib"]
        if use_cuda:
            nv = nvml.devices[r["rank"]] if r["rank"] < len(nvml.devices) else {}
            facts["nvml"] = nv
            facts["cuda_memory_total_gib"] = memory_gib
            memory_gib = nv.get("memory_total_gib") or memory_gib  # the NVML total, as the catalog's figures
            name = nv.get("name") or torch.cuda.get_device_name(r["rank"])
            dev_id, kind = f"{host}-cuda{r['rank']}", "cuda"
        else:
            name, dev_id, kind = f"cpu-worker ({_cpu_name()})", cpu_worker_device_id(host, r["rank"]), "cpu-worker"
        devices.append(Device(
            device_id=dev_id, node_id=host, model_name=one_line(name), generation=None, kind=kind,
            memory_gib=memory_gib, peak_tflops=r["gemm_tflops"], bf16=r["bf16"],
            compute_score=r["gemm_tflops"] / REFERENCE_TFLOPS, hbm_bandwidth_gbps=r["memory_bandwidth_gbps"],
            max_micro_batch=max(1, r["max_micro_batch"]), op_timings_ms=r["op_timings_ms"], facts=facts))
    for r in ranks:
        for dst, link in r["links"].items():
            links.append(Link(src_device_id=devices[r["rank"]].device_id, dst_device_id=devices[int(dst)].device_id,
                              bandwidth_gbps=link["bandwidth_gbps"], latency_us=link["latency_us"],
                              kind="nccl" if use_cuda else "gloo"))
    return ClusterProfile(cluster_id=cluster_id or host, devices=devices, links=links, source="probe",
                          measured_at=dt.datetime.now(dt.UTC), notes=notes)


def _measured_host(measured: ClusterProfile, node_id: str) -> Host:
    """A host only measured, for a declared topology: its slowest measured link inside it (GB/s, us),
    or, with one device, the slowest measured link at all (a one-device host has no pair inside it, so
    without any measured link its placeholder figures are never used)."""
    ids = {d.device_id for d in measured.devices if d.node_id == node_id}
    inside = [lk for lk in measured.links if lk.src_device_id in ids and lk.dst_device_id in ids] or measured.links
    slowest = min(inside, key=lambda lk: lk.bandwidth_gbps, default=None)
    if slowest is None:
        return Host(host_id=node_id, intra_kind="measured", intra_bandwidth_gbps=1.0, intra_latency_us=0.0)
    return Host(host_id=node_id, intra_kind=slowest.kind, intra_bandwidth_gbps=slowest.bandwidth_gbps,
                intra_latency_us=slowest.latency_us)


def merge_profiles(declared: ClusterProfile, measured: ClusterProfile) -> ClusterProfile:
    """Merge a declared inventory with measurements.

    A device in both (same id) takes the measured compute, memory bandwidth, op timings, largest
    micro-batch, bf16 support and facts, and, when measured on a GPU (``kind == "cuda"``), its memory
    (the total the device reports beats the declared or catalog figure); it keeps the declared name
    and ``available_until``. Devices only declared stay as declared; devices only measured are added.
    Measured links replace declared ones (and override what the declared topology derives); a host
    only measured joins the declared topology with the slowest link measured inside it.
    """
    measured_by_id = {d.device_id: d for d in measured.devices}
    devices = []
    for d in declared.devices:
        m = measured_by_id.pop(d.device_id, None)
        if m is None:
            devices.append(d)
            continue
        update = {
            "peak_tflops": m.peak_tflops, "compute_score": m.compute_score,
            "hbm_bandwidth_gbps": m.hbm_bandwidth_gbps, "op_timings_ms": m.op_timings_ms,
            "max_micro_batch": m.max_micro_batch, "facts": m.facts, "kind": m.kind}
        if m.kind == "cuda":
            update["memory_gib"] = m.memory_gib
        if m.bf16 is not None:
            update["bf16"] = m.bf16
        devices.append(d.model_copy(update=update))
    devices.extend(measured_by_id.values())
    links = {(link.src_device_id, link.dst_device_id): link for link in declared.links}
    links.update({(link.src_device_id, link.dst_device_id): link for link in measured.links})
    topology = declared.topology
    if topology is not None:  # hosts only measured join the declared topology, each with its measured figures
        known = {h.host_id for h in topology.hosts}
        extra = [_measured_host(measured, node_id) for node_id in dict.fromkeys(d.node_id for d in devices)
                 if node_id not in known]
        topology = topology.model_copy(update={"hosts": topology.hosts + extra}) if extra else topology
    return ClusterProfile(cluster_id=declared.cluster_id, devices=devices, links=list(links.values()),
                          topology=topology, source="merged", measured_at=measured.measured_at,
                          notes=declared.notes + measured.notes)
