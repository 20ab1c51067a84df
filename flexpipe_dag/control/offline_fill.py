"""Offline work on the devices online serving does not hold: one pipeline instance per free-device set.

Model (what the mixed-day simulation, :mod:`flexpipe_dag.control.mixed_day`, charges offline work):

* **Instance.** Over a stretch of time in which the online side holds a fixed set of devices, the
  rest of the fleet runs *one* offline pipeline instance, planned on exactly those free devices by
  the planner (:func:`~flexpipe_dag.planner.gears.plan_kind`, kind ``throughput``, on a cluster cut
  down to them, for the backlog's own lengths: :func:`~flexpipe_dag.planner.workload.plan_workload_from_trace`).
  When the KV pool cannot hold the planned concurrency, it is halved (64, 32, ... 4); when no plan
  fits at all, those devices do no offline work (said in :attr:`OfflineInstance.note`).
* **Warm-up.** A new instance first loads its weights from host memory: each stage's weights over
  ``load_gbps`` (GB/s, PCIe-class), stages in parallel, so ``max(stage weight bytes) / load_gbps``.
  Nothing is produced meanwhile.
* **Work.** The instance serves the backlog in order, all jobs queued at once (offline class), in
  the discrete-event simulator (:class:`~flexpipe_dag.sim.Simulator`, the planner's cost model for
  stage times, prompts over the model's context cut from the left): a job counts when its last
  token is out.
* **Preemption.** When the free set changes (a gear shift takes or frees devices), the instance is
  stopped: its unfinished jobs go back to the front of the backlog, their partial work is lost (a
  real preemption of a batch job, recomputed later), and the instance for the new free set warms up.
  A job is completed at most once and is never dropped: every job taken from the backlog is either
  completed or back in it (:attr:`OfflineRun.lost`, :attr:`OfflineRun.duplicated` are 0 by construction
  and checked).

Pure: planner and simulator only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.errors import FlexPipeError, InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.planner.gears import make_search, plan_kind, to_gear
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.workload import plan_workload_from_trace
from flexpipe_dag.sim import SimConfig, Simulator
from flexpipe_dag.workload.request import Request, Workload

#: Host-to-device weight load bandwidth a new offline instance warms up at, GB/s (PCIe 3.0 x16 class).
DEFAULT_LOAD_GBPS = 10.0
#: Concurrencies tried, largest first, when planning an offline instance on a set of free devices.
OFFLINE_CONCURRENCIES = (64, 32, 16, 8, 4)
#: Most jobs handed to one instance for one stretch (the doubling of ``run_offline`` stops here).
MAX_CHUNK_JOBS = 1 << 20


def sub_cluster(cluster: ClusterProfile, device_ids: Iterable[str]) -> ClusterProfile:
    """The cluster cut down to ``device_ids`` (the links among them and their hosts kept).

    Raises:
        InputError: an id not in the cluster, or no ids.
    """
    keep = set(device_ids)
    known = {d.device_id for d in cluster.devices}
    unknown = sorted(keep - known)
    if unknown:
        raise InputError(cluster.cluster_id, "device_ids", f"unknown devices {unknown}; expected ids of the cluster")
    if not keep:
        raise InputError(cluster.cluster_id, "device_ids", "expected at least one device")
    return cluster.restricted(keep, f"{cluster.cluster_id}-free{len(keep)}")


@dataclass(frozen=True)
class OfflineInstance:
    """The offline pipeline planned on one set of free devices (``gear`` None: nothing fits there)."""

    device_ids: frozenset[str]
    gear: Gear | None
    timing: StageTimingModel | None
    load_s: float
    note: str


def weight_load_s(gear: Gear, load_gbps: float) -> float:
    """Seconds to load a gear's weights from host memory: the heaviest stage over ``load_gbps`` GB/s."""
    if not load_gbps > 0:
        raise InputError("offline instance", "load_gbps", f"got {load_gbps}; expected GB/s > 0")
    heaviest_gib = max(st.weight_gib or 0.0 for st in gear.stages)
    return heaviest_gib * 2**30 / (load_gbps * 1e9)


class OfflinePlanner:
    """Plans, and remembers, the offline instance for each set of free devices (module docstring)."""

    def __init__(self, cluster: ClusterProfile, spec: ModelSpec, backlog: Workload, *, dtype: str = "bf16",
                 load_gbps: float = DEFAULT_LOAD_GBPS):
        """Args:
            cluster: the whole fleet; instances are planned on parts of it.
            spec: the model offline jobs run (the online one: one set of weights in the fleet).
            backlog: the offline jobs; their lengths are what an instance is planned for.
            load_gbps: host-to-device weight load bandwidth, GB/s.
        """
        self.cluster, self.spec, self.dtype, self.load_gbps = cluster, spec, dtype, load_gbps
        self.backlog = backlog
        self._cache: dict[frozenset[str], OfflineInstance] = {}

    def instance(self, device_ids: Iterable[str]) -> OfflineInstance:
        """The instance on these devices, planned once per distinct set."""
        key = frozenset(device_ids)
        if key not in self._cache:
            self._cache[key] = self._plan(key)
        return self._cache[key]

    @property
    def instances(self) -> list[OfflineInstance]:
        """Every instance planned so far, in planning order."""
        return list(self._cache.values())

    def _plan(self, key: frozenset[str]) -> OfflineInstance:
        if not key:
            return OfflineInstance(key, None, None, 0.0, "no free devices")
        from flexpipe_dag.planner.cost_model import CostModel

        sub = sub_cluster(self.cluster, key)
        why = ""
        for concurrency in OFFLINE_CONCURRENCIES:
            workload, _ = plan_workload_from_trace(self.backlog, max_context_tokens=self.spec.max_context_tokens,
                                                   context_policy="truncate", concurrency=concurrency,
                                                   min_residence_s=0.0)
            try:
                search = make_search(sub, self.spec, dtype=self.dtype, workload=workload)
                gear = to_gear(search, "throughput", plan_kind(search, "throughput"))
            except FlexPipeError as exc:
                why = str(exc)
                continue
            timing = CostModel(self.spec, sub, dtype=gear.dtype).timings(gear)
            return OfflineInstance(key, gear, timing, weight_load_s(gear, self.load_gbps),
                                   f"{len(gear.device_ids)} of {len(key)} free devices, {len(gear.stages)} stages, "
                                   f"planned for concurrency {concurrency}")
        return OfflineInstance(key, None, None, 0.0, f"no offline pipeline fits on {len(key)} free devices: {why}")


class OfflineBacklog:
    """The offline jobs in order, taken from the front, put back at the front when preempted.

    With ``cycle`` the jobs repeat without end (pass ``k`` > 0 gets ids ``<id>~k``), for a backlog
    that outlasts the day; without it the backlog is the jobs once.
    """

    def __init__(self, jobs: Sequence[Request], *, cycle: bool = False):
        if not jobs:
            raise InputError("offline backlog", "jobs", "expected at least one offline job")
        self._jobs = tuple(jobs)
        self.cycle = cycle
        self._next = 0
        self._returned: deque[Request] = deque()
        self.taken = 0
        self.size = len(jobs)

    def __len__(self) -> int:
        """Jobs still waiting (for a cycling backlog: ``inf`` is not an int, so the returned ones plus one pass)."""
        return len(self._returned) + (self.size if self.cycle else self.size - self._next)

    def take(self, n: int) -> list[Request]:
        """Up to ``n`` jobs from the front (returned ones first), queued offline at 0 s."""
        out: list[Request] = []
        while self._returned and len(out) < n:
            out.append(self._returned.popleft())
        while len(out) < n and (self.cycle or self._next < self.size):
            r = self._jobs[self._next % self.size]
            k = self._next // self.size
            out.append(Request(r.request_id if k == 0 else f"{r.request_id}~{k}", 0.0, r.input_tokens, r.output_tokens,
                               "offline", r.priority))
            self._next += 1
            self.taken += 1
        return out

    def put_back(self, jobs: Sequence[Request]) -> None:
        """Return unfinished jobs to the front, in their order."""
        self._returned.extendleft(reversed(list(jobs)))

    @property
    def waiting_returned(self) -> int:
        """Jobs taken and put back, waiting at the front."""
        return len(self._returned)


@dataclass(frozen=True)
class Completion:
    """One offline job finished at ``t_s`` (day clock) with its processed tokens (prompt + output); ``shared``: in
    the online gear's spare capacity (:mod:`flexpipe_dag.control.offline_share`), not on free devices."""

    t_s: float
    request_id: str
    tokens: int
    output_tokens: int
    shared: bool = False


@dataclass
class OfflineRun:
    """What the offline side did over the day.

    Attributes:
        completions: every job finished, in time order.
        preempted: jobs stopped part-way (first token out, not finished) at a stretch's end (a change of
            free devices, or the day's end): put back, their partial work lost.
        refused: times an instance refused a job it cannot hold (over its KV pool; put back for another).
        warmup_s: seconds instances spent loading weights.
        segments: ``(start_s, end_s, free devices, devices the instance used)`` per stretch.
        taken / pending: jobs taken from the backlog, and taken ones back in it at the end.
    """

    completions: list[Completion] = field(default_factory=list)
    preempted: int = 0
    refused: int = 0
    warmup_s: float = 0.0
    segments: list[tuple[float, float, int, int]] = field(default_factory=list)
    taken: int = 0
    pending: int = 0

    @property
    def tokens(self) -> int:
        """Processed tokens (prompt + output) of completed jobs."""
        return sum(c.tokens for c in self.completions)

    @property
    def output_tokens(self) -> int:
        """Generated tokens of completed jobs."""
        return sum(c.output_tokens for c in self.completions)

    @property
    def shared_tokens(self) -> int:
        """Processed tokens of the jobs completed in the online gear's spare capacity."""
        return sum(c.tokens for c in self.completions if c.shared)

    @property
    def duplicated(self) -> int:
        """Completions beyond the first for a job id (0 by construction)."""
        return len(self.completions) - len({c.request_id for c in self.completions})

    @property
    def lost(self) -> int:
        """Jobs taken from the backlog that were neither completed nor put back (0 by construction)."""
        return self.taken - len({c.request_id for c in self.completions}) - self.pending


def merge_segments(segments: Sequence[tuple[float, float, frozenset[str]]]) -> list[tuple[float, float, frozenset[str]]]:
    """Adjacent stretches with the same free devices joined (the instance keeps running across them)."""
    out: list[tuple[float, float, frozenset[str]]] = []
    for a, b, free in sorted(segments, key=lambda s: s[0]):
        if b <= a:
            continue
        if out and out[-1][2] == free and math.isclose(out[-1][1], a, abs_tol=1e-9):
            out[-1] = (out[-1][0], b, free)
        else:
            out.append((a, b, free))
    return out


def run_offline(segments: Sequence[tuple[float, float, frozenset[str]]], planner: OfflinePlanner,
                backlog: OfflineBacklog, *, warmup: bool = True, chunk_jobs: int = 1024) -> OfflineRun:
    """Run the backlog on the free devices of each stretch of the day (module docstring).

    Args:
        segments: ``(start_s, end_s, free device ids)``, day clock; adjacent equal sets are merged.
        warmup: charge each new instance its weight load (False: free restarts, for a bound).
        chunk_jobs: jobs first handed to an instance for a stretch; doubled (and the stretch simulated
            again) while the instance runs dry before the stretch ends, so it never idles with work queued.

    Returns:
        The :class:`OfflineRun`; jobs unfinished at a stretch's end are back in ``backlog``.
    """
    run = OfflineRun()
    sizes: dict[frozenset[str], int] = {}
    sim_config = SimConfig(max_context_tokens=planner.spec.max_context_tokens, context_policy="truncate",
                           slo_ttft_ms=1e12, slo_tpot_ms=1e12)
    for start_s, end_s, free in merge_segments(segments):
        inst = planner.instance(free)
        used = len(inst.gear.device_ids) if inst.gear is not None else 0
        run.segments.append((start_s, end_s, len(free), used))
        if inst.gear is None or inst.timing is None:
            continue
        load_s = inst.load_s if warmup else 0.0
        run.warmup_s += min(load_s, end_s - start_s)
        t = start_s + load_s
        if t >= end_s:
            continue
        # hand the instance enough jobs for the whole stretch: a pipeline that ran dry and restarted would
        # pay a cold start (every slot prefilling at once) a real instance streaming its queue never pays
        n = sizes.get(free, chunk_jobs)
        while True:
            jobs = backlog.take(n)
            if not jobs:
                break
            sim = Simulator(Workload.from_requests(jobs, name="offline"), inst.gear, inst.timing, sim_config)
            sim.advance(end_s - t)
            df = sim.result().requests
            done = df["finish_s"].notna().to_numpy() & ~df["rejected"].to_numpy(dtype=bool)
            if sim.finished and len(jobs) == n and done.any() and n < MAX_CHUNK_JOBS:
                backlog.put_back(jobs)  # it ran dry before the stretch ended: again, with twice the jobs
                n *= 2
                continue
            break
        sizes[free] = n
        if not jobs:
            continue
        finish = df["finish_s"].to_numpy(dtype=float)
        tokens = (df["input_tokens"] + df["output_tokens"]).to_numpy()
        out_tokens = df["output_tokens"].to_numpy()
        run.completions.extend(Completion(t + float(finish[i]), jobs[i].request_id, int(tokens[i]), int(out_tokens[i]))
                               for i in range(len(jobs)) if done[i])
        run.refused += int(df["rejected"].sum())
        run.preempted += int((df["first_token_s"].notna().to_numpy() & ~done).sum())
        unfinished = [r for r, ok in zip(jobs, done) if not ok]
        if unfinished:  # back at the front: the next instance (or stretch) starts them again
            backlog.put_back(unfinished)
    run.completions.sort(key=lambda c: c.t_s)
    run.taken = backlog.taken
    run.pending = backlog.waiting_returned
    return run
