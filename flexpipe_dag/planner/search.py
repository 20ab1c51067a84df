"""Heterogeneous pipeline search: which devices, in what order, how many layers each, how many replicas.

Objective (throughput). A request costs stage ``s`` (``k_s`` layers on device ``d_s``, ``r_s`` replicas)
the busy time::

    busy_s = ( prefill_s(P) + O * decode_s(b, b * C) / b ) / r_s                [ms per request]

with ``P`` the mean prompt, ``O`` the mean output tokens, ``b`` the micro-batch size and ``C`` the mean
decode context; a link between adjacent stages costs ``(P + O) * act_bytes / (bandwidth * u_max)``
(the 70 % traffic rule turned into a time). The pipeline serves at most ``1 / max(busy)`` requests
per ms. The search minimises the bottleneck ``T* = min max(busy_s, link_s)`` subject to memory::

    weights(k_s, first, last) + ceil(N / r_s) * C95 * kv_bytes_per_token_layer * k_s
        + workspace(max(b, chunk)) <= memory * (1 - reserve)      for every stage

Method ("enumerated bottleneck", as Alpa's stage construction, Zheng et al. OSDI'22, Sec. 5.2).
Decoder layers are identical, so at a bottleneck ``T`` device ``d`` in role ``first`` / ``middle`` /
``last`` / ``single`` holds at most ``cap_role(d, T)`` layers (busy and memory both grow with
``k``). ``T`` is feasible iff some first device ``f`` and last device ``l != f`` give::

    cap_first(f, T) + cap_last(l, T) + sum_{d != f, l} cap_middle(d, T) >= L

which is checked in O(devices) with the best two gains ``cap_first - cap_middle`` and
``cap_last - cap_middle``. A binary search over the sorted candidate values of ``busy`` finds the least
feasible ``T``; the plan then takes ``f``, ``l`` and the fewest middle devices (largest capacity, or
fastest first for latency), orders them so devices of one node are adjacent, re-tightens ``T`` for
that set and gives each stage its capacity, trimming the excess from the slowest stages. Unused
devices of the same GPU model then become replicas of the bottleneck stage while that lowers it.
For ``D`` devices and ``L`` layers one bottleneck search costs O(log(D L) * D); exactness against the
exhaustive oracle is tested on random small instances.

Device classes (fleet scale). Devices of equal profile (cost-model key, usable memory, largest
micro-batch, bf16) in equal positions (hosts of equal intra-host figures and size, under the same
network tiers, no measured pair of their own) are interchangeable: every plan over one member has
an equal twin over another. A plan uses at most ``L`` devices (each stage holds a layer) plus at most
:data:`MAX_REPLICA_ROUNDS` replicas, so the search keeps the first ``L + MAX_REPLICA_ROUNDS`` members
of each class (in the profile's order, which fills hosts and racks one by one) and leaves the rest
out (:func:`device_classes`). Feasibility and the least bottleneck are then those of the whole fleet
(any covering set needs at most ``L`` members of a class), plans pick among interchangeable devices in
the profile's order, and the search costs O(classes x (L + replicas)) devices however many the fleet holds:
10,000 GPUs of four types on a handful of host shapes plan as a few hundred devices. A cluster
without a topology (explicit links only) has one class per device, which is the plain per-device
search.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from flexpipe_dag.core.cluster import ClusterProfile, Device
from flexpipe_dag.core.errors import InfeasibleError
from flexpipe_dag.planner.cost_model import CostModel, DeviceKey
from flexpipe_dag.planner.model_spec import GIB
from flexpipe_dag.planner.workload import PlanWorkload

MIDDLE, FIRST, LAST, SINGLE = 0, 1, 2, 3
ROLE_FLAGS = {MIDDLE: (False, False), FIRST: (True, False), LAST: (False, True), SINGLE: (True, True)}
#: Devices with equal profiles are interchangeable: (cost-model key, usable memory GiB, largest micro-batch or None).
DeviceProfile = tuple[DeviceKey, float, int | None]
#: What makes two plans the same: (micro-batch size, device ids per stage, layers per stage).
PlanSignature = tuple[int, tuple[tuple[str, ...], ...], tuple[int, ...]]
#: Most replicas :meth:`PipelineSearch.add_replicas` gives a plan (one per round).
MAX_REPLICA_ROUNDS = 64


@dataclass(frozen=True)
class DeviceClass:
    """Interchangeable devices: equal profile in equal positions (see the module docstring).

    Attributes:
        key: what the members share (device profile, bf16, host figures and size; a device id for a
            device with measured pairs of its own, or on a cluster without a topology).
        device_ids: every member, in the profile's order.
        kept: how many of the first members the search plans with.
    """

    key: tuple[object, ...]
    device_ids: tuple[str, ...]
    kept: int


def device_classes(cluster: ClusterProfile, devices: list[Device], profile_of: dict[str, DeviceProfile],
                   members_max: int | None) -> list[DeviceClass]:
    """Group ``devices`` (of ``cluster``, in its order) into :class:`DeviceClass` es, keeping at most
    ``members_max`` members of each (``None``: all), in order of each class's first member."""
    topology = cluster.topology
    host_size: dict[str, int] = {}
    for d in devices:
        host_size[d.node_id] = host_size.get(d.node_id, 0) + 1
    groups: dict[tuple[object, ...], list[str]] = {}
    for d in devices:
        if topology is None or cluster.link_is_overridden(d.device_id):
            position: tuple[object, ...] = ("device", d.device_id)
        else:
            position = (*topology.position_key(d.node_id), host_size[d.node_id])
        groups.setdefault((profile_of[d.device_id], d.lacks_bf16, *position), []).append(d.device_id)
    return [DeviceClass(key, tuple(ids), len(ids) if members_max is None else min(len(ids), members_max))
            for key, ids in groups.items()]


@dataclass
class StageTables:
    """Per-layer-count figures of one device profile at one micro-batch size and replica count.

    Arrays have shape ``(4, L + 1)`` indexed ``[role, k]`` (``k`` layers; ``k = 0`` is ``inf`` busy).
    ``busy_ms`` is ``inf`` where the stage does not fit in memory.
    """

    busy_ms: np.ndarray
    decode_ms: np.ndarray
    prefill_ms: np.ndarray
    memory_bytes: np.ndarray
    usable_bytes: float
    layer_busy_ms: float


@dataclass
class PipelinePlan:
    """One candidate pipeline: ordered stages ``(device_ids, num_layers)`` at ``micro_batch_size`` sequences per micro-batch."""

    micro_batch_size: int
    device_ids: list[list[str]]
    sizes: list[int]
    stage_busy_ms: list[float]
    link_busy_ms: list[float]
    origin: str = "search"
    notes: list[str] = field(default_factory=list)

    @property
    def bottleneck_ms(self) -> float:
        return max(self.stage_busy_ms + self.link_busy_ms)

    @property
    def num_stages(self) -> int:
        return len(self.sizes)

    def signature(self) -> PlanSignature:
        return (self.micro_batch_size, tuple(tuple(d) for d in self.device_ids), tuple(self.sizes))


class PipelineSearch:
    """Search state for one model on one cluster under one workload.

    Memory: a stage fits a device when its bytes are at most :meth:`Device.usable_memory_gib` at the
    workload's ``reserve_fraction`` (reported total less the CUDA context reserve, less the fraction).

    Args:
        cost_model: prices stages and links.
        workload: planning assumptions.
        now: the time availability windows are measured from (default: the profile's ``measured_at``).
        exclude_device_ids: devices left out for another reason (a dtype they cannot run), with
            ``notes`` saying why.
        notes: what planning changed on the way (dtype fallback, devices left out), for the user.
        class_members_max: members of each device class the search plans with (module docstring;
            default ``L + MAX_REPLICA_ROUNDS``, where no plan can tell the difference; ``None`` keeps
            every device).

    Raises:
        InfeasibleError: no device stays available for ``min_residence_s``.
    """

    def __init__(self, cost_model: CostModel, workload: PlanWorkload, now: dt.datetime | None = None,
                 exclude_device_ids: tuple[str, ...] = (), notes: list[str] | None = None,
                 class_members_max: int | None | Literal["default"] = "default"):
        self.cm = cost_model
        self.model = cost_model.model
        self.workload = workload
        self.num_layers = self.model.num_layers
        self.notes: list[str] = list(notes or [])
        #: under the bf16 -> fp16 fallback, the devices with bf16 (a gear on these only stays bf16); else None
        self.bf16_device_ids: frozenset[str] | None = None
        cluster = cost_model.cluster
        now = now or cluster.measured_at
        self.excluded = [d.device_id for d in cluster.devices if d.available_for_s(now) < workload.min_residence_s]
        excluded = set(self.excluded)
        self.excluded_for_dtype = [i for i in exclude_device_ids if i not in excluded]
        left_out = excluded | set(self.excluded_for_dtype)
        #: every device the plan may use; the search plans with :attr:`pool`, its classes' kept members
        self.usable: list[Device] = [d for d in cluster.devices if d.device_id not in left_out]
        if not self.usable:
            why = []
            if self.excluded:
                why.append(f"{len(self.excluded)} become unavailable within the minimum residence of "
                           f"{workload.min_residence_s:.0f} s (their available_until; --min-residence-s)")
            if self.excluded_for_dtype:
                why.append(f"{len(self.excluded_for_dtype)} have no {cost_model.dtype} (left out by the bf16 fallback "
                           "'exclude'; --bf16-fallback fp16 runs them in fp16)")
            raise InfeasibleError(f"no device of cluster {cluster.cluster_id} is left to plan on: of its "
                                  f"{len(cluster.devices)}, " + "; ".join(why))
        self._profile_of: dict[str, DeviceProfile] = {}
        for d in self.usable:
            self._profile_of[d.device_id] = (cost_model.device_key(d.device_id),
                                             d.usable_memory_gib(workload.reserve_fraction), d.max_micro_batch)
        members_max = self.num_layers + MAX_REPLICA_ROUNDS if class_members_max == "default" else class_members_max
        self.classes = device_classes(cluster, self.usable, self._profile_of, members_max)
        kept = {i for c in self.classes for i in c.device_ids[:c.kept]}
        self.pool: list[Device] = [d for d in self.usable if d.device_id in kept]
        if len(self.pool) < len(self.usable):
            self.notes.append(f"{len(self.usable)} usable devices planned as {len(self.classes)} classes of "
                              f"interchangeable devices, {len(self.pool)} of them searched (at most "
                              f"{members_max} per class: {self.num_layers} layers + {MAX_REPLICA_ROUNDS} replicas)")
        self.profiles = sorted(set(self._profile_of.values()), key=repr)
        self._profile_index = np.array([self.profiles.index(self._profile_of[d.device_id]) for d in self.pool])
        self._rep: dict[DeviceProfile, str] = {}
        for d in self.pool:
            self._rep.setdefault(self._profile_of[d.device_id], d.device_id)
        self._tables: dict[tuple[DeviceProfile, int, int], StageTables] = {}
        self._node = {d.device_id: d.node_id for d in self.pool}
        dt_ = cost_model.dtype
        self._act_bytes = self.model.activation_bytes_per_token(dt_)
        self._layer_w = self.model.layer_weight_bytes(dt_)
        self._first_w = self.model.first_stage_extra_bytes(dt_)
        self._last_w = self.model.last_stage_extra_bytes(dt_)
        self._tied = self.model.tied_saving_bytes(dt_)
        self._kv_layer_token = self.model.kv_bytes_per_token_per_layer(dt_)
        self._ws_token = self.model.activation_workspace_bytes_per_token(dt_)

    # -- tables -------------------------------------------------------------------------------
    def profile(self, device_id: str) -> DeviceProfile:
        return self._profile_of[device_id]

    def tables(self, device_id: str, micro_batch_size: int, replicas: int = 1) -> StageTables:
        """Stage figures for ``device_id``'s profile (cached per profile, micro-batch, replicas)."""
        prof = self._profile_of[device_id]
        key = (prof, micro_batch_size, replicas)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        dev = self._rep[prof]
        w, L, cm = self.workload, self.num_layers, self.cm
        ks = np.arange(L + 1, dtype=float)
        ctx = int(round(micro_batch_size * w.decode_context_mean_tokens))
        layer_dec = cm.layer_decode_ms(dev, micro_batch_size, ctx)
        layer_pf = cm.layer_prefill_ms(dev, w.prompt_tokens_mean)
        emb_dec, emb_pf = cm.first_extra_ms(dev, micro_batch_size), cm.first_extra_ms(dev, w.prompt_tokens_mean)
        head_dec, head_pf = cm.last_extra_ms(dev, micro_batch_size), cm.last_extra_ms(dev, 1)
        kv_seqs = math.ceil(w.concurrency / replicas)
        usable = self.cm.device(dev).usable_memory_gib(w.reserve_fraction) * GIB
        ws = max(micro_batch_size, w.prefill_chunk_tokens) * self._ws_token
        over_device_max_micro_batch = prof[2] is not None and micro_batch_size > prof[2]
        busy = np.empty((4, L + 1))
        dec = np.empty((4, L + 1))
        pf = np.empty((4, L + 1))
        mem = np.empty((4, L + 1))
        for role, (first, last) in ROLE_FLAGS.items():
            dec[role] = ks * layer_dec + first * emb_dec + last * head_dec
            pf[role] = ks * layer_pf + first * emb_pf + last * head_pf
            mem[role] = (ks * (self._layer_w + kv_seqs * w.context_p95_tokens * self._kv_layer_token)
                         + first * self._first_w + last * self._last_w - (first and last) * self._tied + ws)
            busy[role] = (pf[role] + w.output_tokens_mean * dec[role] / micro_batch_size) / replicas
        busy[:, 0] = np.inf
        busy[mem > usable] = np.inf
        if over_device_max_micro_batch:
            busy[:] = np.inf
        out = StageTables(busy, dec, pf, mem, usable, (layer_pf + w.output_tokens_mean * layer_dec / micro_batch_size) / replicas)
        self._tables[key] = out
        return out

    def link_busy_ms(self, src: str, dst: str) -> float:
        """Per-request link time at the allowed utilisation, ms (``inf`` without a link)."""
        link = self.cm.link(src, dst)
        if link is None:
            return math.inf
        w = self.workload
        moved = (w.prompt_tokens_mean + w.output_tokens_mean) * self._act_bytes
        return moved / (link.bandwidth_gbps * 1e9 * w.link_utilisation_max) * 1e3

    # -- capacities -----------------------------------------------------------------------------
    def _caps(self, micro_batch_size: int, limit_ms: float) -> np.ndarray:
        """``(devices, 4)`` layer capacities of every pool device at bottleneck ``limit_ms``."""
        per_profile = np.empty((len(self.profiles), 4), dtype=int)
        for p_i, prof in enumerate(self.profiles):
            t = self.tables(self._rep[prof], micro_batch_size)
            for role in range(4):
                per_profile[p_i, role] = int(np.searchsorted(t.busy_ms[role, 1:], limit_ms, side="right"))
        caps: np.ndarray = np.minimum(per_profile[self._profile_index], self.num_layers)
        return caps

    def feasible(self, micro_batch_size: int, limit_ms: float) -> bool:
        """Whether some device set covers all layers with every stage's busy <= ``limit_ms`` (links aside)."""
        caps = self._caps(micro_batch_size, limit_ms)
        L = self.num_layers
        if (caps[:, SINGLE] >= L).any():
            return True
        if len(self.pool) < 2:
            return False
        mid_total = caps[:, MIDDLE].sum()
        g_first = np.where(caps[:, FIRST] >= 1, caps[:, FIRST] - caps[:, MIDDLE], -10**9)
        g_last = np.where(caps[:, LAST] >= 1, caps[:, LAST] - caps[:, MIDDLE], -10**9)
        f_order = np.argsort(-g_first, kind="stable")[:2]
        l_order = np.argsort(-g_last, kind="stable")[:2]
        best = max(g_first[f] + g_last[last] for f in f_order for last in l_order if f != last)
        return bool(mid_total + best >= L)

    def candidate_limits(self, micro_batch_size: int) -> np.ndarray:
        """Sorted unique finite busy values of every profile, role and layer count (the enumerated bottlenecks)."""
        vals = [self.tables(self._rep[p], micro_batch_size).busy_ms.ravel() for p in self.profiles]
        allv = np.concatenate(vals)
        return np.unique(allv[np.isfinite(allv)])

    def min_limit(self, micro_batch_size: int) -> float | None:
        """Least feasible bottleneck at ``micro_batch_size`` (binary search over :meth:`candidate_limits`)."""
        cand = self.candidate_limits(micro_batch_size)
        if len(cand) == 0 or not self.feasible(micro_batch_size, cand[-1]):
            return None
        lo, hi = 0, len(cand) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.feasible(micro_batch_size, cand[mid]):
                hi = mid
            else:
                lo = mid + 1
        return float(cand[lo])

    # -- construction ---------------------------------------------------------------------------
    def construct(self, micro_batch_size: int, limit_ms: float, prefer: str = "capacity", num_stages: int | None = None,
                  max_pairs: int = 3) -> list[PipelinePlan]:
        """Plans whose stages all fit ``limit_ms`` (links may exceed it; they count in the bottleneck).

        Args:
            prefer: ``"capacity"`` fills middle stages with the devices holding most layers (fewest
                stages, lowest bottleneck); ``"speed"`` with the fastest per layer (lowest latency).
            num_stages: force exactly this many stages (``None``: as few as needed).
        """
        caps = self._caps(micro_batch_size, limit_ms)
        L = self.num_layers
        ids = [d.device_id for d in self.pool]
        speed = np.array([self.tables(i, micro_batch_size).layer_busy_ms for i in ids])
        plans: list[PipelinePlan] = []
        if num_stages in (None, 1):
            singles = [i for i in range(len(ids)) if caps[i, SINGLE] >= L]
            if singles:
                i = min(singles, key=lambda j: (speed[j], ids[j]))
                single = self._finish(micro_batch_size, [ids[i]], limit_ms)
                if single is not None:
                    plans.append(single)
            if num_stages == 1:
                return plans
        if len(ids) < 2:
            return plans
        g_first = np.where(caps[:, FIRST] >= 1, caps[:, FIRST] - caps[:, MIDDLE], -10**9)
        g_last = np.where(caps[:, LAST] >= 1, caps[:, LAST] - caps[:, MIDDLE], -10**9)
        if prefer == "speed":
            key = lambda i: (speed[i], -caps[i, MIDDLE], ids[i])  # noqa: E731
        else:
            key = lambda i: (-caps[i, MIDDLE], speed[i], ids[i])  # noqa: E731
        f_top = sorted(range(len(ids)), key=lambda i: (-g_first[i], speed[i], ids[i]))[:max_pairs]
        l_top = sorted(range(len(ids)), key=lambda i: (-g_last[i], speed[i], ids[i]))[:max_pairs]
        mid_sorted = sorted(range(len(ids)), key=key)
        for f in f_top:
            for last in l_top:
                if f == last or caps[f, FIRST] < 1 or caps[last, LAST] < 1:
                    continue
                covered = caps[f, FIRST] + caps[last, LAST]
                mids: list[int] = []
                want = None if num_stages is None else num_stages - 2
                for i in mid_sorted:
                    if want is None and covered >= L:
                        break
                    if want is not None and len(mids) >= want:
                        break
                    if i in (f, last) or caps[i, MIDDLE] < 1:
                        continue
                    mids.append(i)
                    covered += caps[i, MIDDLE]
                if covered < L or (want is not None and len(mids) < want):
                    continue
                order = self._order(ids[f], [ids[i] for i in mids], ids[last])
                plan = self._finish(micro_batch_size, order, limit_ms)
                if plan is not None:
                    plans.append(plan)
        return plans

    def _order(self, first: str, mids: list[str], last: str) -> list[str]:
        """First, middles grouped by node (first's node, then others, then last's node), last."""
        nf, nl = self._node[first], self._node[last]

        def rank(d: str) -> tuple[int, str, str]:
            n = self._node[d]
            return (0 if n == nf else 2 if n == nl else 1, n, d)

        return [first, *sorted(mids, key=rank), last]

    def _finish(self, micro_batch_size: int, order: list[str], limit_ms: float) -> PipelinePlan | None:
        """Tighten the bottleneck for this ordered device set and split the layers (exact for it)."""
        L, S = self.num_layers, len(order)
        if S > L:
            return None
        roles = [SINGLE] if S == 1 else [FIRST] + [MIDDLE] * (S - 2) + [LAST]
        links = [self.link_busy_ms(a, c) for a, c in zip(order, order[1:])]
        if any(math.isinf(x) for x in links):
            return None
        rows = np.stack([self.tables(d, micro_batch_size).busy_ms[r, 1:] for d, r in zip(order, roles)])   # (S, L)
        cand = np.unique(rows)
        cand = cand[np.isfinite(cand) & (cand <= limit_ms * (1 + 1e-12))]

        def caps_at(t: float) -> np.ndarray:
            counts: np.ndarray = (rows <= t).sum(axis=1)
            return counts

        lo, hi = 0, len(cand) - 1
        if hi < 0:
            return None
        c_hi = caps_at(cand[hi])
        if c_hi.min() < 1 or c_hi.sum() < L:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            c = caps_at(cand[mid])
            if c.min() >= 1 and c.sum() >= L:
                hi = mid
            else:
                lo = mid + 1
        sizes = [int(x) for x in np.minimum(caps_at(cand[lo]), L)]
        excess = sum(sizes) - L
        # trim the excess from the stages slowest per layer (keeps layers on fast devices)
        slow_first = sorted(range(S), key=lambda i: -self.tables(order[i], micro_batch_size).layer_busy_ms)
        while excess > 0:
            for i in slow_first:
                if excess and sizes[i] > 1:
                    take = min(excess, sizes[i] - 1)
                    sizes[i] -= take
                    excess -= take
        busy = [float(r[k - 1]) for r, k in zip(rows, sizes)]
        return PipelinePlan(micro_batch_size, [[d] for d in order], sizes, busy, links)

    # -- replicas -------------------------------------------------------------------------------
    def add_replicas(self, plan: PipelinePlan, max_rounds: int = MAX_REPLICA_ROUNDS) -> PipelinePlan:
        """Give the bottleneck stage data-parallel replicas from unused devices of its profile, while that lowers the bottleneck."""
        used = {d for ds in plan.device_ids for d in ds}
        spare_by_profile: dict[DeviceProfile, list[str]] = {}
        for d in self.pool:
            if d.device_id not in used:
                spare_by_profile.setdefault(self._profile_of[d.device_id], []).append(d.device_id)
        device_ids = [list(ds) for ds in plan.device_ids]
        busy = list(plan.stage_busy_ms)
        S = plan.num_stages
        taken: set[str] = set()
        by_head: dict[str, list[str]] = {}  # a head's spare devices, its own node first, then by id
        for _ in range(max_rounds):
            s = int(np.argmax(busy))
            if busy[s] < max(plan.link_busy_ms, default=0.0):
                break
            head = device_ids[s][0]
            role = SINGLE if S == 1 else FIRST if s == 0 else LAST if s == S - 1 else MIDDLE
            r = len(device_ids[s]) + 1
            t = self.tables(head, plan.micro_batch_size, r)
            new_busy = float(t.busy_ms[role, plan.sizes[s]])
            if not new_busy < busy[s]:
                break
            same = by_head.get(head)
            if same is None:
                same = by_head[head] = sorted(spare_by_profile.get(self._profile_of[head], []),
                                              key=lambda d: (self._node[d] != self._node[head], d))
            pick = next((d for d in same if d not in taken and self._links_ok(d, device_ids, s)), None)
            if pick is None:
                break
            taken.add(pick)
            device_ids[s].append(pick)
            busy[s] = new_busy
        if device_ids == plan.device_ids:
            return plan
        return PipelinePlan(plan.micro_batch_size, device_ids, list(plan.sizes), busy, list(plan.link_busy_ms),
                            plan.origin, plan.notes)

    def _links_ok(self, device_id: str, device_ids: list[list[str]], s: int) -> bool:
        prev_ok = s == 0 or all(self.cm.link(p, device_id) for p in device_ids[s - 1])
        next_ok = s == len(device_ids) - 1 or all(self.cm.link(device_id, n) for n in device_ids[s + 1])
        return bool(prev_ok and next_ok)

    # -- evaluation of a fixed split (baselines, oracle) ----------------------------------------
    def evaluate_split(self, micro_batch_size: int, order: list[str], sizes: list[int], origin: str) -> PipelinePlan | None:
        """Price a given ordered device list and layer split; ``None`` if a stage does not fit or a link is missing."""
        S = len(order)
        roles = [SINGLE] if S == 1 else [FIRST] + [MIDDLE] * (S - 2) + [LAST]
        busy = [float(self.tables(d, micro_batch_size).busy_ms[r, k]) for d, r, k in zip(order, roles, sizes)]
        links = [self.link_busy_ms(a, c) for a, c in zip(order, order[1:])]
        if any(math.isinf(x) for x in busy + links):
            return None
        return PipelinePlan(micro_batch_size, [[d] for d in order], list(sizes), busy, links, origin)

    # -- diagnostics ----------------------------------------------------------------------------
    def explain_infeasible(self) -> str:
        """The binding constraint when no plan exists, in words with numbers."""
        w, L = self.workload, self.num_layers
        usable = sum(d.usable_memory_gib(w.reserve_fraction) for d in self.usable)
        weights = self.model.weight_bytes(self.cm.dtype) / GIB
        excl = f" ({len(self.excluded)} device(s) excluded by available_until)" if self.excluded else ""
        if self.excluded_for_dtype:
            excl += f" ({len(self.excluded_for_dtype)} device(s) left out: no {self.cm.dtype})"
        if weights > usable:
            return (f"model needs {weights:.1f} GiB of weights ({self.cm.dtype}), cluster has {usable:.1f} GiB usable "
                    f"after the CUDA context and the {w.reserve_fraction:.0%} reserve on {len(self.usable)} device(s){excl}")
        kv = L * w.concurrency * w.context_p95_tokens * self._kv_layer_token / GIB
        if weights + kv > usable:
            per_sequence_gib = L * w.context_p95_tokens * self._kv_layer_token / GIB
            fit = max(0, int((usable - weights) // per_sequence_gib)) if per_sequence_gib > 0 else 0
            return (f"weights {weights:.1f} GiB + KV pool {kv:.1f} GiB (concurrency {w.concurrency} x P95 context "
                    f"{w.context_p95_tokens} tokens) exceed the {usable:.1f} GiB usable on {len(self.usable)} device(s)"
                    f"{excl}; at most {fit} sequence(s) of {w.context_p95_tokens} tokens fit beside the weights in "
                    "all: lower --concurrency or --context-p95, use a smaller dtype, or add devices")
        one_layer = max((self._layer_w + w.concurrency * w.context_p95_tokens * self._kv_layer_token) / GIB, 0)
        biggest = max(d.usable_memory_gib(w.reserve_fraction) for d in self.usable)
        if one_layer > biggest:
            return (f"one layer's weights + KV pool need {one_layer:.2f} GiB, the largest device has {biggest:.1f} GiB usable")
        extra = max(self._first_w, self._last_w) / GIB
        return (f"no pipeline fits: the first / last stage must hold the embedding / LM head ({extra:.2f} GiB) plus at "
                f"least one layer with its KV pool, and all {L} layers must fit across {len(self.usable)} device(s){excl}; "
                f"lower --concurrency or --context-p95, or use a smaller dtype")
