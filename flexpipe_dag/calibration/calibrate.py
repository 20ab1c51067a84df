"""Observations -> a calibration: per-device efficiency factors and per-link figures that plug into the cost model.

For each device (or, with ``group_by="model"``, each group of devices with the same model name and
profiled figures) the observed steps are priced by the prior cost model
(:func:`~flexpipe_dag.calibration.work.roofline_terms`: the profile's peak TFLOP/s and GB/s, the
default per-class efficiencies and any earlier calibration's overrides), and three time scales
``(compute, memory, overhead)`` are fitted robustly (:func:`~flexpipe_dag.calibration.fit.fit_time_scales`).
They become per-class :class:`~flexpipe_dag.planner.cost_model.Efficiency` overrides::

    compute_c' = compute_c / k_compute     memory_c' = memory_c / k_memory     overhead_c' = overhead_c * k_overhead

(clipped to the cost model's valid range, ``(0, 1.5]``; a clip is noted). A device with too little
evidence gets no override: it keeps its profiled values. Links get effective latency / bandwidth
(:func:`~flexpipe_dag.calibration.links.fit_link`) applied to a *copy* of the profile
(:meth:`Calibration.calibrated_cluster`); the probe's raw figures are never modified.

Feeding a calibration back as ``prior`` of the next one chains them: new evidence refines the last
calibrated model rather than starting again from the raw profile.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from flexpipe_dag.calibration.fit import TERMS, FitSettings, TimeScaleFit, fit_time_scales
from flexpipe_dag.calibration.links import LinkFit, fit_link
from flexpipe_dag.calibration.observation import StageObservation
from flexpipe_dag.calibration.work import predict_terms_ms, roofline_terms, step_work_by_class
from flexpipe_dag.core.cluster import ClusterProfile, Link
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.cost_model import CostModel, Efficiency, default_efficiency
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.operators import OP_CLASSES

#: Efficiency factors must stay inside the cost model's accepted range.
EFFICIENCY_MIN, EFFICIENCY_MAX = 1e-4, 1.5


@dataclass(frozen=True)
class DeviceCalibration:
    """One device's calibration.

    Attributes:
        device_id, model_name: the device; ``group``: the devices whose steps were pooled with it.
        fit: the time-scale fit (scales, confidence, counts, errors before / after).
        overrides: ``{op_class: Efficiency}`` for the cost model, or ``None`` (profile kept).
        clipped: classes whose factor hit the valid range.
    """

    device_id: str
    model_name: str
    group: tuple[str, ...]
    fit: TimeScaleFit
    overrides: dict[str, Efficiency] | None
    clipped: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.overrides is not None

    def summary(self) -> str:
        """One line for people, e.g. ``T4-0: compute 1.40x slower than profiled (+-8 %), ...``."""
        if not self.changed:
            return f"{self.device_id}: profile kept ({'; '.join(self.fit.notes) or 'no evidence'})"
        parts = []
        for t in TERMS:
            k = self.fit.scales[t]
            if not self.fit.identified[t]:
                parts.append(f"{t} as profiled (not identified)")
                continue
            word = "slower" if k >= 1 else "faster"
            ratio = k if k >= 1 else 1 / k
            parts.append(f"{t} {ratio:.2f}x {word} than profiled (+-{self.fit.log_sd[t]:.0%})")
        return (f"{self.device_id}: " + ", ".join(parts)
                + f"; {self.fit.num_used}/{self.fit.num_observations} steps, median error "
                  f"{self.fit.median_ape_before:.0%} -> {self.fit.median_ape_after:.0%}")


@dataclass(frozen=True)
class Calibration:
    """A calibration of one cluster profile for one model and dtype (plain data; see module docstring).

    Attributes:
        cluster_id, model_name, dtype: what it calibrates.
        devices: ``{device_id: DeviceCalibration}`` for every device of the profile.
        links: fitted / kept links that had observations.
        created_at: when it was computed.
        num_observations: steps it was fitted on.
        base_overrides: the prior's overrides (an earlier calibration), merged under the new ones.
    """

    cluster_id: str
    model_name: str
    dtype: str
    devices: dict[str, DeviceCalibration]
    links: list[LinkFit]
    created_at: dt.datetime
    num_observations: int
    base_overrides: dict[str, dict[str, Efficiency]] = field(default_factory=dict)

    def device_overrides(self) -> dict[str, dict[str, Efficiency]]:
        """``{device_id: {op_class: Efficiency}}`` for :class:`CostModel` (devices without evidence keep the prior's)."""
        out = {d: dict(v) for d, v in self.base_overrides.items()}
        for dev, cal in self.devices.items():
            if cal.overrides is not None:
                out[dev] = dict(cal.overrides)
        return out

    def calibrated_cluster(self, cluster: ClusterProfile) -> ClusterProfile:
        """A copy of ``cluster`` with fitted link figures (devices and the original object untouched).

        Raises:
            InputError: ``cluster`` is another cluster than the one calibrated.
        """
        if cluster.cluster_id != self.cluster_id:
            raise InputError("calibration", "cluster_id", f"calibrated {self.cluster_id!r}, got {cluster.cluster_id!r}")
        fitted = {(link.src_device_id, link.dst_device_id): link for link in self.links if link.fitted}
        links = [link.model_copy(update={"bandwidth_gbps": fitted[(link.src_device_id, link.dst_device_id)].bandwidth_gbps,
                                      "latency_us": fitted[(link.src_device_id, link.dst_device_id)].latency_us})
                 if (link.src_device_id, link.dst_device_id) in fitted else link for link in cluster.links]
        # a fitted pair the topology derived becomes an override of its own
        explicit = {(link.src_device_id, link.dst_device_id) for link in cluster.links}
        links += [Link(src_device_id=src, dst_device_id=dst, bandwidth_gbps=fit.bandwidth_gbps,
                       latency_us=fit.latency_us, kind="calibrated")
                  for (src, dst), fit in sorted(fitted.items()) if (src, dst) not in explicit]
        return cluster.model_copy(update={"links": links, "notes": list(cluster.notes) + [
            f"links calibrated {self.created_at.isoformat(timespec='seconds')} from {self.num_observations} observed steps"]},
            deep=True)

    def cost_model(self, model: ModelSpec, cluster: ClusterProfile, efficiency: Mapping[str, Efficiency] | None = None
                   ) -> CostModel:
        """The calibrated cost model for ``model`` on ``cluster``."""
        return CostModel(model, self.calibrated_cluster(cluster), dtype=self.dtype, efficiency=efficiency,
                         device_overrides=self.device_overrides())

    def changed_devices(self) -> list[str]:
        return [d for d, c in self.devices.items() if c.changed]

    def summary_lines(self) -> list[str]:
        lines = [c.summary() for c in self.devices.values()]
        for link in self.links:
            if link.fitted:
                lines.append(f"link {link.src_device_id} -> {link.dst_device_id}: {link.bandwidth_gbps:.3g} GB/s, "
                             f"{link.latency_us:.0f} us (profiled {link.prior_bandwidth_gbps:.3g} GB/s, "
                             f"{link.prior_latency_us:.0f} us; {link.num_observations} hand-offs)")
            else:
                lines.append(f"link {link.src_device_id} -> {link.dst_device_id}: profile kept ({'; '.join(link.notes)})")
        return lines

    # -- plain-data form (the store keeps it as JSON) ----------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def eff(d: Mapping[str, Efficiency] | None) -> dict[str, dict[str, Any]] | None:
            return {c: asdict(e) for c, e in d.items()} if d is not None else None

        return {
            "cluster_id": self.cluster_id, "model_name": self.model_name, "dtype": self.dtype,
            "created_at": self.created_at.isoformat(), "num_observations": self.num_observations,
            "base_overrides": {k: eff(v) for k, v in self.base_overrides.items()},
            "devices": {k: {"device_id": c.device_id, "model_name": c.model_name, "group": list(c.group),
                            "fit": asdict(c.fit), "overrides": eff(c.overrides), "clipped": list(c.clipped)}
                        for k, c in self.devices.items()},
            "links": [asdict(link) for link in self.links],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        def eff(d: Mapping[str, Mapping[str, Any]]) -> dict[str, Efficiency]:
            return {c: Efficiency(**e) for c, e in dict(d).items()}  # dict(None) is a TypeError: not a document

        def eff_or_none(d: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Efficiency] | None:
            return eff(d) if d is not None else None

        try:
            devices = {k: DeviceCalibration(c["device_id"], c["model_name"], tuple(c["group"]), TimeScaleFit(**c["fit"]),
                                            eff_or_none(c["overrides"]), tuple(c.get("clipped", ())))
                       for k, c in data["devices"].items()}
            links = [LinkFit(**{**link, "notes": tuple(link.get("notes", ()))}) for link in data.get("links", [])]
            return cls(data["cluster_id"], data["model_name"], data["dtype"], devices, links,
                       dt.datetime.fromisoformat(data["created_at"]), int(data["num_observations"]),
                       {k: eff(v) for k, v in data.get("base_overrides", {}).items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError("calibration", None, f"not a calibration document: {exc}") from None


#: Devices calibrated together: ``(device_id,)``, or ``(model_name, peak TFLOP/s, HBM GB/s)``.
GroupKey = tuple[str | float, ...]


def _group_key(cluster: ClusterProfile, device_id: str, group_by: str) -> GroupKey:
    if group_by == "device":
        return (device_id,)
    d = cluster.device(device_id)
    return (d.model_name, d.peak_tflops, d.hbm_bandwidth_gbps)


def _overrides(prior: Mapping[str, Efficiency], scales: Mapping[str, float]) -> tuple[dict[str, Efficiency], list[str]]:
    out, clipped = {}, []
    for c in OP_CLASSES:
        e = prior[c]
        comp = e.compute / scales["compute"]
        mem = e.memory / scales["memory"]
        cc = min(EFFICIENCY_MAX, max(EFFICIENCY_MIN, comp))
        mm = min(EFFICIENCY_MAX, max(EFFICIENCY_MIN, mem))
        if cc != comp or mm != mem:
            clipped.append(c)
        out[c] = Efficiency(compute=cc, memory=mm, overhead_us=e.overhead_us * scales["overhead"])
    return out, clipped


def observation_terms(model: ModelSpec, cluster: ClusterProfile, observations: list[StageObservation], dtype: str,
                      efficiency: Mapping[str, Efficiency]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unit roofline terms of observations that all ran on one device profile (see ``roofline_terms``)."""
    d = cluster.device(observations[0].device_id)
    return roofline_terms([step_work_by_class(model, o, dtype) for o in observations], d.peak_tflops,
                          d.hbm_bandwidth_gbps, efficiency)


def calibrate(model: ModelSpec, cluster: ClusterProfile, observations: Iterable[StageObservation], *,
              dtype: str = "bf16", efficiency: Mapping[str, Efficiency] | None = None,
              prior: Calibration | None = None, settings: FitSettings | None = None,
              group_by: Literal["device", "model"] = "device", now: dt.datetime | None = None) -> Calibration:
    """Fit a calibration of ``cluster`` for ``model`` from observed stage steps.

    Args:
        model: the model the steps ran (its operator counts price each step).
        cluster: the profile the prior cost model used (devices named by the observations).
        observations: steps from :class:`~flexpipe_dag.runtime.observations.ObservationCollector` or the store.
        dtype: the dtype the steps ran in (``fp32`` for the CPU runtime).
        efficiency: default per-class factors (default :func:`default_efficiency`).
        prior: an earlier calibration of this cluster, refined rather than replaced.
        settings: priors and evidence thresholds (:class:`FitSettings`).
        group_by: ``device`` (default) or ``model``: pool steps of devices with the same model name and
            profiled figures, and apply the pooled fit to every such device.

    Returns:
        A :class:`Calibration` with an entry per device of ``cluster``.

    Raises:
        InputError: an observation names a device not in ``cluster``, or ``group_by`` is unknown.
    """
    if group_by not in ("device", "model"):
        raise InputError("calibrate", "group_by", f"expected 'device' or 'model', got {group_by!r}")
    settings = settings or FitSettings()
    base = dict(efficiency or default_efficiency())
    base_over = prior.device_overrides() if prior is not None else {}
    obs = list(observations)
    known = {d.device_id for d in cluster.devices}
    for o in obs:
        if o.device_id not in known:
            raise InputError("observations", "device_id", f"device {o.device_id!r} is not in cluster {cluster.cluster_id!r}")
    by_group: dict[GroupKey, list[StageObservation]] = defaultdict(list)
    for o in obs:
        by_group[_group_key(cluster, o.device_id, group_by)].append(o)
    members: dict[GroupKey, list[str]] = defaultdict(list)
    for d in cluster.devices:
        members[_group_key(cluster, d.device_id, group_by)].append(d.device_id)
    devices: dict[str, DeviceCalibration] = {}
    for key, devs in members.items():
        group_obs = by_group.get(key, [])
        rep = devs[0]
        prior_eff = {**base, **base_over.get(rep, {})}
        if group_obs:
            tc, tm, to = observation_terms(model, cluster, group_obs, dtype, prior_eff)
            fit = fit_time_scales(tc, tm, to, np.array([o.wall_ms for o in group_obs]), settings)
        else:
            fit = fit_time_scales(np.zeros((0, 1)), np.zeros((0, 1)),
                                  np.zeros((0, 1)), np.zeros(0), settings)
        for dev in devs:
            dev_prior = {**base, **base_over.get(dev, {})}
            over, clipped = _overrides(dev_prior, fit.scales) if fit.fitted else (None, [])
            devices[dev] = DeviceCalibration(dev, cluster.device(dev).model_name, tuple(devs), fit, over, tuple(clipped))
    links = []
    sends: dict[tuple[str, str], list[StageObservation]] = defaultdict(list)
    for o in obs:
        if o.send_ms is not None and o.dst_device_id is not None:
            sends[(o.device_id, o.dst_device_id)].append(o)
    for (src, dst), group in sorted(sends.items()):
        link = cluster.link(src, dst)
        if link is None:
            continue
        links.append(fit_link(src, dst, np.array([o.send_bytes for o in group]), np.array([o.send_ms for o in group]),
                              link.bandwidth_gbps, link.latency_us))
    return Calibration(cluster.cluster_id, model.name, dtype, devices, links,
                       now or dt.datetime.now(dt.UTC), len(obs), base_over)


def predicted_step_ms(cost_model: CostModel, observations: list[StageObservation]) -> np.ndarray:
    """What ``cost_model`` predicts for each observed step, ms (same order)."""
    out = np.empty(len(observations))
    eff_all = {d.device_id: {**cost_model.efficiency, **cost_model.device_overrides.get(d.device_id, {})}
               for d in cost_model.cluster.devices}
    for i, o in enumerate(observations):
        d = cost_model.device(o.device_id)
        tc, tm, to = roofline_terms([step_work_by_class(cost_model.model, o, cost_model.dtype)], d.peak_tflops,
                                    d.hbm_bandwidth_gbps, eff_all[o.device_id])
        out[i] = predict_terms_ms(tc, tm, to)[0]
    return out
