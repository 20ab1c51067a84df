"""Estimated gain of a shift, and the design's payback test.

Payback (``DESIGN.md`` seed figures): a shift is worth it when
``estimated_gain_fraction x expected_residence_s > migration_cost_s``. The gain is a fraction of
full service (0..1, "goodput-equivalent"), so gain x residence is the seconds of full service the
shift buys and the migration cost the seconds it spends.

Gain of moving from the serving gear ``c`` to a candidate ``g`` at smoothed load ``q``::

    gain = [goodput(g) - goodput(c)]                       always
         + headroom_weight x [headroom(g) - headroom(c)]   triggers imbalance, latency_under
         + latency_weight  x [slack(g) - slack(c)]         triggers rps_below_envelope, latency_over
         + envelope_fit_weight x [fit(g) - fit(c)]         always
         - device_weight x [n(g) - n(c)] / max(n(g), n(c))  triggers imbalance, latency_under,
                                                            rps_below_envelope

    goodput(x)  = min(1, capacity(x) / q) x min(1, T / p99(x))   SLO goodput fraction
    headroom(x) = max(0, 1 - q / capacity(x))                   spare capacity fraction
    slack(x)    = max(0, 1 - p99(x) / T)                        latency slack fraction
    fit(x)      = 1 if rps_min(x) <= q <= rps_max(x) else 0      planner's envelope contains q
    n(x)        = devices the gear holds (one per stage replica)

``p99(g)`` is calibrated by how the serving gear's estimate fared: ``p99(g) = e(g) x
max(1, observed(c) / estimate(c))``, where ``e(g)`` is the planner's estimate, capped at the target
``T`` when ``g``'s envelope holds ``q`` (the envelope is the load range in which the planner found the
gear meeting its latency target; its P99 estimate is taken at the envelope's top, so it would
otherwise count a gear as missing the target at loads it was chosen to hold). Where the cost model proved optimistic for the gear serving
now (say it sees 7.5 s against an estimated 1.8 s), a candidate's estimate is trusted no more;
this keeps the controller from "fixing" a latency problem by moving to a gear the same model
flatters in the same way (often the same hardware under another name). A backlogged serving gear's
P99 measures its queue, not the model's error, and calibrates nothing.

``capacity(x)`` is the gear's ``rps_max`` (the most load it serves within its latency target, as
the planner set it), else its estimated throughput, else unbounded, times ``1 - upshift_headroom_fraction``
(the share of an envelope the controller plans to use; 1 with the seeds); for the serving gear it is
also capped by what its busiest stage shows, ``q / max stage utilisation`` (a stage 95 % busy at
3 req/s saturates near 3.2 req/s whatever the plan said) and, when it is backlogged (more requests waiting than
running), by the rate at which it actually completes requests. ``p99(c)`` is the observed
smoothed P99; ``p99(g)`` the planner's estimate (``Gear.estimate``), and a gear without an
estimate is taken to meet ``T`` (its slack term is then 0 for both sides). Each trigger values the
trade-off it exists for: a low-latency gear and a roomy gear pull in opposite directions, so the
trigger's intent picks which one counts. The device term is the price of what a gear holds: on a
fragmented fleet the devices the serving gear leaves free go to offline work in the troughs, so a
roomier gear must buy more service than the share of devices it adds (with ``device_weight`` 0.2, a move
from 3 to 4 devices needs a 5 % goodput gain; from 8 to 3 devices gains 0.125 of full service).
It is charged only on the discretionary moves (imbalance, latency well under target, load below the
envelope): a gear that no longer holds the load (``rps_above_envelope``, ``forecast_above_envelope``,
``latency_over``) or is unhealthy must be left whatever the devices, since a backlog costs far more
than the ``capacity / q`` share the goodput term sees. For ``forecast_above_envelope`` the controller
values candidates at the forecast load, so holding the coming peak counts as goodput.
"""

from __future__ import annotations

import math

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.state import DISCRETIONARY_TRIGGERS
from flexpipe_dag.core.gear import Gear

_HEADROOM_TRIGGERS = frozenset({"imbalance", "latency_under"})
_SLACK_TRIGGERS = frozenset({"rps_below_envelope", "latency_over"})


def capacity_rps(gear: Gear) -> float:
    """Requests/s the gear serves within its latency target: ``rps_max``, else estimated throughput, else inf."""
    if math.isfinite(gear.rps_max):
        return gear.rps_max
    if gear.estimate is not None and gear.estimate.throughput_rps > 0:
        return gear.estimate.throughput_rps
    return math.inf


def estimated_p99_ms(gear: Gear, latency_metric: str) -> float | None:
    """The planner's P99 estimate for ``latency_metric`` (``ttft_p99_ms`` / ``tpot_p99_ms``), or None."""
    if gear.estimate is None:
        return None
    value = getattr(gear.estimate, latency_metric, None)
    return float(value) if value is not None else None


def calibrated_p99_ms(candidate: Gear, current: Gear, current_p99_ms: float | None,
                      latency_metric: str, within_target_ms: float | None = None) -> float | None:
    """The candidate's estimated P99, scaled by ``max(1, observed / estimated)`` of the serving gear, ms.

    ``within_target_ms``: the latency target when the candidate's envelope holds the load; its
    estimate is then capped at it before scaling. None when the candidate has no estimate. See the
    module docstring.
    """
    est = estimated_p99_ms(candidate, latency_metric)
    if est is None:
        return None
    if within_target_ms is not None:
        est = min(est, within_target_ms)
    est_cur = estimated_p99_ms(current, latency_metric)
    if current_p99_ms is not None and est_cur is not None and est_cur > 0:
        est *= max(1.0, current_p99_ms / est_cur)
    return est


def fits_envelope(gear: Gear, rps: float, margin_fraction: float = 0.0) -> bool:
    """``rps_min x (1 + m) <= rps <= rps_max x (1 - m)``: the envelope holds ``rps`` with margin ``m``.

    The controller leaves a gear when the load is outside its envelope *widened* by the margin and
    enters one only when the load is inside it *narrowed* by the margin: a band of 2 m on each
    edge in which neither the exit nor the entry fires (a Schmitt trigger on the request rate axis).
    """
    return gear.rps_min * (1.0 + margin_fraction) <= rps <= gear.rps_max * (1.0 - margin_fraction)


def goodput_fraction(capacity: float, rps: float, p99_ms: float | None, target_p99_ms: float) -> float:
    """Expected SLO goodput fraction: served share x share of the latency target met (both 0..1)."""
    served = 1.0 if rps <= 0 or capacity >= rps else capacity / rps
    slo = 1.0 if p99_ms is None or p99_ms <= target_p99_ms else target_p99_ms / p99_ms
    return served * slo


def headroom_fraction(capacity: float, rps: float) -> float:
    """Spare capacity fraction ``max(0, 1 - rps / capacity)`` (1 when capacity is unbounded)."""
    if math.isinf(capacity):
        return 1.0
    return max(0.0, 1.0 - rps / capacity) if capacity > 0 else 0.0


def latency_slack_fraction(p99_ms: float | None, target_p99_ms: float) -> float | None:
    """``max(0, 1 - p99 / target)``; None when the P99 is unknown."""
    if p99_ms is None:
        return None
    return max(0.0, 1.0 - p99_ms / target_p99_ms)


def estimated_gain_fraction(trigger: str, current: Gear, candidate: Gear, *, rps: float,
                            current_p99_ms: float | None, target_p99_ms: float,
                            config: ControllerConfig, current_max_stage_busy: float | None = None,
                            current_completed_rps: float | None = None, backlogged: bool = False) -> float:
    """Gain of shifting ``current -> candidate`` at smoothed load ``rps`` (formula in the module docstring).

    Args:
        trigger: the trigger that proposes the shift (selects the trade-off terms).
        rps: smoothed arrivals per second.
        current_p99_ms: observed smoothed P99 of the serving gear, ms (None if no request finished yet).
        target_p99_ms: the latency SLO, ms.
        current_max_stage_busy: smoothed utilisation (0..1) of the serving gear's busiest stage, or None.
        current_completed_rps: smoothed completions per second of the serving gear, or None.
        backlogged: the serving gear has more requests waiting than running (smoothed). Its
            capacity is then what it completes, and its P99 measures the backlog, not the cost
            model's error, so candidates' estimates are not calibrated by it.
    """
    metric = config.latency_metric
    cur_p99 = current_p99_ms if current_p99_ms is not None else estimated_p99_ms(current, metric)
    new_p99 = calibrated_p99_ms(candidate, current, None if backlogged else current_p99_ms, metric,
                                within_target_ms=target_p99_ms if fits_envelope(candidate, rps) else None)
    keep = 1.0 - config.upshift_headroom_fraction  # the share of an envelope the controller plans to use
    cap_c, cap_g = keep * capacity_rps(current), keep * capacity_rps(candidate)
    if current_max_stage_busy is not None and current_max_stage_busy > 0 and rps > 0:
        cap_c = min(cap_c, rps / min(1.0, current_max_stage_busy))
    if backlogged and current_completed_rps is not None:
        cap_c = min(cap_c, current_completed_rps)
    gain = goodput_fraction(cap_g, rps, new_p99, target_p99_ms) - goodput_fraction(cap_c, rps, cur_p99, target_p99_ms)
    if trigger in _HEADROOM_TRIGGERS:
        gain += config.headroom_weight * (headroom_fraction(cap_g, rps) - headroom_fraction(cap_c, rps))
    if trigger in _SLACK_TRIGGERS:
        slack_c = latency_slack_fraction(cur_p99, target_p99_ms)
        slack_g = latency_slack_fraction(new_p99, target_p99_ms)
        if slack_c is not None and slack_g is not None:
            gain += config.latency_weight * (slack_g - slack_c)
    gain += config.envelope_fit_weight * (float(fits_envelope(candidate, rps)) - float(fits_envelope(current, rps)))
    if trigger in DISCRETIONARY_TRIGGERS:
        n_c, n_g = len(current.device_ids), len(candidate.device_ids)
        gain -= config.device_weight * (n_g - n_c) / max(n_g, n_c)
    return gain


def pays_back(gain_fraction: float, expected_residence_s: float, migration_cost_s: float) -> bool:
    """Design payback test: ``gain_fraction x expected_residence_s > migration_cost_s``."""
    return gain_fraction * expected_residence_s > migration_cost_s


def figure(value: float, digits: int = 3) -> str:
    """``value`` in plain decimals to ``digits`` significant figures, trailing zeros dropped.

    ``0.000412 -> "0.000412"``, ``0.72 -> "0.72"``, ``56.25 -> "56.2"``, ``1800 -> "1800"``, ``0 -> "0"``:
    no exponent, so a small gain reads as what it is rather than ``0.000``.
    """
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _distinct(a: float, b: float) -> tuple[str, str, int]:
    """``a`` and ``b`` as :func:`figure` writes them, and the significant digits used: 3, more (up to 9) when 3
    would show two different numbers alike."""
    for digits in range(3, 10):
        fa, fb = figure(a, digits), figure(b, digits)
        if fa != fb or a == b:
            break
    return fa, fb, digits


def payback_arithmetic(gain_fraction: float, expected_residence_s: float, migration_cost_s: float, *,
                       cost_estimated: bool = True) -> str:
    """The payback test as an operator reads it, its comparison sign taken from the test itself.

    ``"gain 0.0412 x residence 1800 s = 74.2 s > migration cost 12.3 s"``; ``<=`` when it does not pay back.
    A cost that was not estimated says so: ``cost_estimated=False`` (the controller's
    ``default_migration_cost_s`` stood in) adds ``(default, not estimated)``, and a cost of 0 s
    ``(none estimated: no weights move, no drain counted)``.

    Args:
        gain_fraction: estimated gain, fraction of full service (:func:`estimated_gain_fraction`).
        expected_residence_s: seconds the target gear is expected to serve.
        migration_cost_s: seconds the shift costs.
        cost_estimated: whether ``migration_cost_s`` came from a cost estimate (else a default).
    """
    bought_s = gain_fraction * expected_residence_s
    sign = ">" if pays_back(gain_fraction, expected_residence_s, migration_cost_s) else "<="
    bought, cost, shown_digits = _distinct(bought_s, migration_cost_s)
    residence = f"{expected_residence_s:.0f}"
    for digits in range(3, 6):  # digits of the gain enough for the product shown to follow from the figures shown
        gain = figure(gain_fraction, digits)
        if figure(float(gain) * float(residence), shown_digits) == bought:
            break
    if not cost_estimated:
        cost += " s (default, not estimated)"
    elif migration_cost_s == 0:
        cost += " s (none estimated: no weights move, no drain counted)"
    else:
        cost += " s"
    return (f"gain {gain} x residence {residence} s = {bought} s {sign} "
            f"migration cost {cost}")
