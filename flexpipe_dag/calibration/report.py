"""Fidelity report: predicted vs measured TTFT / TPOT service time and stage time, before and after calibration.

From the observed steps of each gear that ran:

* **stage time**: per stage and kind, the median step (ms) measured, and predicted by the prior and by
  the calibrated cost model for the same steps;
* **TTFT (service)**: per micro-batch that carried a prefill, its time through every stage plus the
  hand-offs - the first token's latency without queueing; median over micro-batches;
* **TPOT (service)**: the same for decode-only micro-batches - the decode round trip, the time per
  output token of a pipeline that is not saturated.

Predictions use each step's own counts (:func:`~flexpipe_dag.calibration.calibrate.predicted_step_ms`)
and the cost model's link time for the hand-offs, so the comparison isolates the cost model's error
from the workload. Queueing is not in these figures (the simulator and the live metric samples carry it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flexpipe_dag.calibration.calibrate import predicted_step_ms
from flexpipe_dag.calibration.observation import KINDS, StageObservation
from flexpipe_dag.planner.cost_model import CostModel


def _transfer_ms(cm: CostModel, o: StageObservation) -> float:
    if o.dst_device_id is None or o.is_last:
        return 0.0
    link = cm.link(o.device_id, o.dst_device_id)
    return link.transfer_ms(o.send_bytes) if link is not None else 0.0


def fidelity_rows(observations: Sequence[StageObservation], before: CostModel,
                  after: CostModel) -> list[dict[str, Any]]:
    """Report rows, per gear: ``{gear_id, metric, stage, kind, count, measured_ms, before_ms, after_ms}``.

    ``metric`` is ``stage_time`` (per stage and kind), ``ttft_service`` or ``tpot_service`` (stage ``None``).
    """
    obs = list(observations)
    if not obs:
        return []
    y = np.array([o.wall_ms for o in obs])
    pb, pa = predicted_step_ms(before, obs), predicted_step_ms(after, obs)
    rows: list[dict[str, Any]] = []
    by_gear: dict[str, list[int]] = defaultdict(list)
    for i, o in enumerate(obs):
        by_gear[o.gear_id].append(i)
    for gear_id, idx in by_gear.items():
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i in idx:
            groups[(obs[i].stage_index, obs[i].kind)].append(i)
        for (stage, kind), ii in sorted(groups.items(), key=lambda kv: (kv[0][0], KINDS.index(kv[0][1]))):
            rows.append({"gear_id": gear_id, "metric": "stage_time", "stage": stage, "kind": kind, "count": len(ii),
                         "measured_ms": float(np.median(y[ii])), "before_ms": float(np.median(pb[ii])),
                         "after_ms": float(np.median(pa[ii]))})
        # whole micro-batches: every stage's step of one mb_id, plus the hand-offs
        num_stages = max(obs[i].stage_index for i in idx) + 1
        per_mb: dict[int, list[int]] = defaultdict(list)
        for i in idx:
            per_mb[obs[i].mb_id].append(i)
        trips: dict[str, list[tuple[float, float, float]]] = {"ttft_service": [], "tpot_service": []}
        for ii in per_mb.values():
            if len(ii) != num_stages:
                continue  # a micro-batch seen by only some stages (a collection cut it)
            sends = [obs[i].send_ms or 0.0 for i in ii]
            meas = float(y[ii].sum() + sum(sends))
            tb = float(pb[ii].sum() + sum(_transfer_ms(before, obs[i]) for i in ii))
            ta = float(pa[ii].sum() + sum(_transfer_ms(after, obs[i]) for i in ii))
            metric = "tpot_service" if obs[ii[0]].kind == "decode" else "ttft_service"
            trips[metric].append((meas, tb, ta))
        for metric, vals in trips.items():
            if vals:
                arr = np.array(vals)
                rows.append({"gear_id": gear_id, "metric": metric, "stage": None, "kind": None, "count": len(vals),
                             "measured_ms": float(np.median(arr[:, 0])), "before_ms": float(np.median(arr[:, 1])),
                             "after_ms": float(np.median(arr[:, 2]))})
    return rows


def format_report(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of :func:`fidelity_rows` (errors as signed percentages of measured).

    The gear column is as wide as the longest gear id (at least 28): ids are never cut.
    """
    gw = max([28, *(len(str(r["gear_id"])) for r in rows)])
    head = f"{'gear':<{gw}} {'metric':<13} {'stage':>5} {'kind':<8} {'n':>5} {'measured ms':>12} " \
           f"{'before ms':>10} {'err':>7} {'after ms':>10} {'err':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        eb = (r["before_ms"] - r["measured_ms"]) / r["measured_ms"]
        ea = (r["after_ms"] - r["measured_ms"]) / r["measured_ms"]
        stage = "" if r["stage"] is None else str(r["stage"])
        lines.append(f"{r['gear_id']:<{gw}} {r['metric']:<13} {stage:>5} {(r['kind'] or ''):<8} {r['count']:>5} "
                     f"{r['measured_ms']:>12.2f} {r['before_ms']:>10.2f} {eb:>+7.0%} {r['after_ms']:>10.2f} {ea:>+7.0%}")
    return "\n".join(lines)
