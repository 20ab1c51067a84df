"""Roofline cost model of pipeline stages on heterogeneous devices.

Every operator class ``c`` (``gemm``, ``attention``, ``norm``, ``elementwise``, ``residual``, ``embedding``) on a
device with ``peak_tflops`` P and ``hbm_bandwidth_gbps`` W takes::

    t_c = kernels_c * overhead_us_c + max( flops_c / (P * compute_c),  bytes_c / (W * memory_c) )

(Williams, Waterman, Patterson 2009, "Roofline"; the fixed per-kernel overhead is the launch and
tail cost visible at small token counts). A stage's time is the sum over its layers' classes, plus
the embedding on the first stage and final norm + LM head on the last:

* prefill of ``n`` prompt tokens: compute-bound for large ``n`` (FLOPs / achievable TFLOP/s),
* decode of a micro-batch of ``b`` sequences with ``C`` cached tokens in total: the weights and the KV
  of ``C`` tokens are read once per step, so it is bandwidth-bound for small ``b`` (bytes / achievable
  GB/s) and becomes compute-bound as ``b`` grows (the max of the two terms),
* transfer of ``n`` tokens' activations over a link: ``latency_us + n x activation bytes / bandwidth``.

The efficiency factors ``compute_c``, ``memory_c``, ``overhead_us_c`` are fitted to the measured
vidur A100 operator times (:mod:`flexpipe_dag.calibration.reference`, stored in
``flexpipe_dag/data/profiling/a100_efficiency.yaml``). They are device-independent defaults; a
calibration step can pass ``device_overrides={device_id: {op_class: Efficiency}}`` measured on
that device.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import yaml

from flexpipe_dag.core.cluster import ClusterProfile, Device, Link
from flexpipe_dag.core.dtypes import canonical_dtype
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.operators import (
    OP_CLASSES,
    embedding_work_by_class,
    head_work_by_class,
    layer_work_by_class,
)

EFFICIENCY_FILE = "profiling/a100_efficiency.yaml"


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of a device's roofline for one operator class.

    Attributes:
        compute: fraction (0, 1] of ``peak_tflops`` achieved when compute-bound.
        memory: fraction (0, 1] of ``hbm_bandwidth_gbps`` achieved when bandwidth-bound.
        overhead_us: fixed time per kernel, microseconds.
    """

    compute: float
    memory: float
    overhead_us: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.compute <= 1.5 and 0 < self.memory <= 1.5 and self.overhead_us >= 0):
            raise ValueError(f"efficiency out of range: {self}")


@functools.cache
def default_efficiency() -> dict[str, Efficiency]:
    """The calibrated per-class factors shipped with the package (see module docstring)."""
    text = importlib.resources.files("flexpipe_dag.data").joinpath(EFFICIENCY_FILE).read_text()
    raw = yaml.safe_load(text)["op_classes"]
    out = {cls: Efficiency(float(r["compute"]), float(r["memory"]), float(r["overhead_us"])) for cls, r in raw.items()}
    missing = set(OP_CLASSES) - set(out)
    if missing:
        raise InputError(EFFICIENCY_FILE, "op_classes", f"missing classes {sorted(missing)}")
    return out


WorkByClass = Mapping[str, tuple[float, float, int]]
#: What makes two devices time alike: (peak TFLOP/s, HBM GB/s, sorted per-class efficiency overrides).
DeviceKey = tuple[float, float, tuple[tuple[str, Efficiency], ...]]
#: Per-device efficiency factors from a calibration: ``{device_id: {op_class: Efficiency}}``.
DeviceOverrides = Mapping[str, Mapping[str, Efficiency]]


def roofline_ms(work: WorkByClass, peak_tflops: float, hbm_bandwidth_gbps: float,
                efficiency: Mapping[str, Efficiency]) -> float:
    """Time of ``work`` (``{class: (flops, bytes, kernels)}``) on a device, ms (formula in module doc)."""
    total = 0.0
    for cls, (flops, moved, kernels) in work.items():
        e = efficiency[cls]
        compute_ms = flops / (peak_tflops * 1e12 * e.compute) * 1e3
        memory_ms = moved / (hbm_bandwidth_gbps * 1e9 * e.memory) * 1e3
        total += kernels * e.overhead_us / 1e3 + max(compute_ms, memory_ms)
    return total


class CostModel:
    """Per-stage prefill / decode / transfer times for one model on one cluster (ms).

    Args:
        model: the model's architecture facts.
        cluster: devices and links.
        dtype: weight dtype (``fp32``, ``bf16``, ``fp16``, ``int8``, ``int4``, or an alias such as
            ``float16``; kept as its canonical name, see :mod:`flexpipe_dag.core.dtypes`).
        efficiency: per-class factors; default :func:`default_efficiency`.
        device_overrides: ``{device_id: {op_class: Efficiency}}`` from a per-device calibration;
            classes not named keep the defaults.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterProfile, *, dtype: str = "bf16",
                 efficiency: Mapping[str, Efficiency] | None = None,
                 device_overrides: DeviceOverrides | None = None):
        self.model = model
        self.cluster = cluster
        self.dtype = canonical_dtype(dtype, "--dtype")
        self.efficiency = dict(efficiency or default_efficiency())
        self.device_overrides = {k: dict(v) for k, v in (device_overrides or {}).items()}
        unknown = set(self.device_overrides) - {d.device_id for d in cluster.devices}
        if unknown:
            raise InputError("device_overrides", None, f"unknown device ids {sorted(unknown)}")
        self._devices = {d.device_id: d for d in cluster.devices}
        self._links: dict[tuple[str, str], Link | None] = {}  # pairs looked up so far (derived ones built once)
        # (device key, work tag, arguments) -> ms, and ("tr", src, dst, tokens) -> ms for transfers
        self._cache: dict[tuple[DeviceKey, str, tuple[float, ...]] | tuple[str, str, str, int], float] = {}

    # -- device-level pieces (cached by device profile, so identical devices share entries) ------
    def device(self, device_id: str) -> Device:
        return self._devices[device_id]

    def device_key(self, device_id: str) -> DeviceKey:
        """Devices with equal keys have equal times: (peak TFLOP/s, HBM GB/s, overrides)."""
        d = self._devices[device_id]
        over = self.device_overrides.get(device_id)
        return (d.peak_tflops, d.hbm_bandwidth_gbps, tuple(sorted(over.items())) if over else ())

    def _eff(self, device_id: str) -> Mapping[str, Efficiency]:
        over = self.device_overrides.get(device_id)
        return {**self.efficiency, **over} if over else self.efficiency

    def _time(self, device_id: str, tag: str, work_fn: Callable[..., WorkByClass], *args: float) -> float:
        key = (self.device_key(device_id), tag, args)
        hit = self._cache.get(key)
        if hit is None:
            d = self._devices[device_id]
            hit = roofline_ms(work_fn(*args), d.peak_tflops, d.hbm_bandwidth_gbps, self._eff(device_id))
            self._cache[key] = hit
        return hit

    def layer_prefill_ms(self, device_id: str, num_tokens: int) -> float:
        """One decoder layer over one causal prompt of ``num_tokens`` tokens, ms: :meth:`layer_step_ms` with
        ``n (n + 1) / 2`` attended pairs."""
        n = float(num_tokens)
        return self.layer_step_ms(device_id, num_tokens, n * (n + 1) / 2, num_tokens)

    def layer_decode_ms(self, device_id: str, num_seqs: int, context_tokens: int) -> float:
        """One decoder layer, one decode step of ``num_seqs`` sequences holding ``context_tokens`` KV tokens in total, ms.

        ``num_seqs`` is the sequences decoding in the step; the search passes a full micro-batch
        (``micro_batch_size``), the simulator the micro-batch's decoding members. :meth:`layer_step_ms`
        with one attended pair per context token.
        """
        return self.layer_step_ms(device_id, num_seqs, context_tokens, context_tokens)

    def first_extra_ms(self, device_id: str, num_tokens: int) -> float:
        """Embedding gather for ``num_tokens`` tokens (first stage only), ms."""
        return self._time(device_id, "emb", lambda n: embedding_work_by_class(self.model, n, self.dtype), float(num_tokens))

    def last_extra_ms(self, device_id: str, num_logit_tokens: int) -> float:
        """Final norm + LM head for ``num_logit_tokens`` tokens (last stage only), ms."""
        return self._time(device_id, "head", lambda n: head_work_by_class(self.model, n, self.dtype), float(num_logit_tokens))

    # -- stages ----------------------------------------------------------------------------------
    def layer_step_ms(self, device_id: str, num_tokens: int, attended_pairs: float, kv_tokens: int) -> float:
        """One decoder layer over a micro-batch packed as the runtime packs it: ``num_tokens`` new tokens
        in one ``[T, hidden]`` pass, attention scoring ``attended_pairs`` query-key pairs and reading
        ``kv_tokens`` cached + new tokens, ms (:func:`~flexpipe_dag.planner.operators.layer_work_by_class`)."""
        return self._time(device_id, "ls", lambda t, p, k: layer_work_by_class(self.model, t, p, k, self.dtype),
                          float(num_tokens), float(attended_pairs), float(kv_tokens))

    def stage_step_ms(self, device_id: str, num_layers: int, first: bool, last: bool, prefill_tokens: int,
                      num_prompts: int, num_decode: int, context_tokens: int) -> float:
        """One micro-batch step on a stage, in one pass over all its tokens (the runtime's layout), ms.

        The step prefills ``prefill_tokens`` tokens of ``num_prompts`` prompts (or prompt chunks), taken
        as equal and each attending within itself, and decodes ``num_decode`` sequences holding
        ``context_tokens`` KV tokens in total. Projections and MLPs run once over all the tokens (one
        weight read, one set of kernels), attention scores ``p n (n + 1) / 2`` prompt pairs plus one
        per context token, the first stage embeds every token and the last computes one logit row per
        sequence. A decode-only step is :meth:`stage_decode_ms`; one whole prompt is :meth:`stage_prefill_ms`.
        """
        prompts = max(1, num_prompts) if prefill_tokens else 0
        per_prompt = prefill_tokens / prompts if prompts else 0.0
        pairs = prompts * per_prompt * (per_prompt + 1) / 2 + context_tokens
        tokens = prefill_tokens + num_decode
        t = num_layers * self.layer_step_ms(device_id, tokens, pairs, prefill_tokens + context_tokens)
        if first:
            t += self.first_extra_ms(device_id, tokens)
        if last:
            t += self.last_extra_ms(device_id, prompts + num_decode)
        return t

    def stage_prefill_ms(self, device_id: str, num_layers: int, first: bool, last: bool, num_tokens: int,
                         num_prompts: int = 1) -> float:
        """Prefill of ``num_tokens`` prompt tokens on a stage of ``num_layers`` layers, ms.

        The tokens are ``num_prompts`` equal causal prompts in one pass: :meth:`stage_step_ms` with no decode.
        One prompt (``num_prompts`` <= 1) is ``num_layers`` x :meth:`layer_prefill_ms` plus the embedding
        (first stage) and one logit row (last stage), to the bit (the same figures, tested).
        """
        return self.stage_step_ms(device_id, num_layers, first, last, num_tokens, num_prompts, 0, 0)

    def stage_decode_ms(self, device_id: str, num_layers: int, first: bool, last: bool, num_seqs: int,
                        context_tokens: int) -> float:
        """One decode step of ``num_seqs`` sequences of a micro-batch (``context_tokens`` KV tokens in total), ms."""
        t = num_layers * self.layer_decode_ms(device_id, num_seqs, context_tokens)
        if first:
            t += self.first_extra_ms(device_id, num_seqs)
        if last:
            t += self.last_extra_ms(device_id, num_seqs)
        return t

    def link(self, src_device_id: str, dst_device_id: str) -> Link | None:
        """The directed link (explicit, else derived from the topology: :meth:`ClusterProfile.link`), or
        ``None`` when the profile has none (the pair cannot be adjacent)."""
        pair = (src_device_id, dst_device_id)
        try:
            return self._links[pair]
        except KeyError:
            link = self._links[pair] = self.cluster.link(src_device_id, dst_device_id)
            return link

    def transfer_ms(self, src_device_id: str, dst_device_id: str, num_tokens: int) -> float:
        """Send ``num_tokens`` tokens' activations ``src -> dst``: latency + bytes / bandwidth, ms.

        Raises:
            KeyError: the cluster profile has no such link.
        """
        key = ("tr", src_device_id, dst_device_id, num_tokens)
        hit = self._cache.get(key)
        if hit is None:
            link = self.link(src_device_id, dst_device_id)
            if link is None:
                raise KeyError(f"no link {src_device_id} -> {dst_device_id}")
            hit = self._cache[key] = link.transfer_ms(num_tokens * self.model.activation_bytes_per_token(self.dtype))
        return hit

    def timings(self, gear: Gear) -> GearTiming:
        """A :class:`~flexpipe_dag.core.timing.StageTimingModel` for ``gear`` on this cluster."""
        return GearTiming(self, gear)


class GearTiming:
    """:class:`~flexpipe_dag.core.timing.StageTimingModel` of one gear (times per replica, ms).

    Stage ``i`` is priced on its first replica's device (replicas of a stage are the same GPU model);
    the transfer after stage ``i`` uses the link from that device to stage ``i + 1``'s first replica.

    Raises:
        InputError: the gear names a device the cluster does not have, or adjacent stages have no link.
    """

    def __init__(self, cost_model: CostModel, gear: Gear):
        self.cost_model = cost_model
        self.gear = gear
        self.num_stages = gear.num_stages
        known = {d.device_id for d in cost_model.cluster.devices}
        for st in gear.stages:
            for dev in st.device_ids:
                if dev not in known:
                    raise InputError(gear.gear_id, f"stages[{st.stage_index}].device_ids",
                                     f"device {dev!r} is not in cluster {cost_model.cluster.cluster_id!r}")
        for a, b in zip(gear.stages, gear.stages[1:]):
            if cost_model.link(a.device_ids[0], b.device_ids[0]) is None:
                raise InputError(gear.gear_id, f"stages[{a.stage_index}]",
                                 f"no link {a.device_ids[0]} -> {b.device_ids[0]} in the cluster profile")

    def _stage(self, i: int) -> tuple[str, int, bool, bool]:
        """Stage ``i``'s (first replica's device, layer count, is first, is last)."""
        st = self.gear.stages[i]
        return st.device_ids[0], st.num_layers, i == 0, i == self.num_stages - 1

    def prefill_ms(self, stage_index: int, num_tokens: int, num_prompts: int = 1) -> float:
        dev, k, first, last = self._stage(stage_index)
        return self.cost_model.stage_prefill_ms(dev, k, first, last, int(num_tokens), int(num_prompts))

    def decode_ms(self, stage_index: int, num_seqs: int, context_tokens: int) -> float:
        dev, k, first, last = self._stage(stage_index)
        return self.cost_model.stage_decode_ms(dev, k, first, last, int(num_seqs), int(context_tokens))

    def step_ms(self, stage_index: int, prefill_tokens: int, num_prompts: int, num_seqs: int,
                context_tokens: int) -> float:
        dev, k, first, last = self._stage(stage_index)
        return self.cost_model.stage_step_ms(dev, k, first, last, int(prefill_tokens), int(num_prompts),
                                             int(num_seqs), int(context_tokens))

    def transfer_ms(self, stage_index: int, num_tokens: int) -> float:
        if stage_index >= self.num_stages - 1:
            return 0.0
        src = self.gear.stages[stage_index].device_ids[0]
        dst = self.gear.stages[stage_index + 1].device_ids[0]
        return self.cost_model.transfer_ms(src, dst, int(num_tokens))
