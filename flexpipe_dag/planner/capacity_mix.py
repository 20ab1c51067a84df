"""The cheapest set of pipeline instances that carries a load: an exact integer program (``scipy.optimize.milp``).

Model. A fleet is a set of *homogeneous pipeline instances*: instance option ``o`` is one pipeline
on ``n_o`` cards of one GPU type, planned by the gear planner, with its SLO envelope ``X_o`` (req/s)
and KV pool ``K_o`` (tokens). Instances serve disjoint shares of the traffic (a load balancer sends
each instance its share), so capacities add up. With ``x_o`` instances of option ``o``::

    minimise    sum_o x_o n_o p_o                       (cost per hour, p_o the type's price per card-hour)
    subject to  sum_o x_o X_o (1 - reserve) >= load_rps (each instance loaded to at most 1 - reserve)
                sum_o x_o K'_o >= kv_need_tokens        (the concurrency at the P95 context fits)
                x_o in {0, 1, 2, ...}

with ``K'_o = min(K_o, X_o (1 - reserve) x kv_need_tokens / load_rps)``: an instance's pool counts
only up to what its own share of the load keeps in flight. Solved exactly by branch and bound
(HiGHS through ``scipy.optimize.milp``); a tiny second term ``1e-6 x cards`` breaks cost ties
toward fewer cards, and a second solve, held to that cost and card count, takes the set with the most
capacity among them (ties are common: two 1-card pipelines or one 2-card pipeline of the same type
cost the same and rarely carry the same). Restricting the options to one GPU type gives
that type alone; all options together give the cheapest mix. The model is additive by construction:
what it does not capture is a pipeline spanning two types (the gear planner's job on a given fleet).

:func:`max_rps_within` answers the reverse question the capacity benchmark asks: the most SLO
capacity a given number of cards can hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexpipe_dag.core.errors import InputError

#: Weight of the card count in the objective, relative to the cheapest card-hour (ties only).
CARD_TIE_WEIGHT = 1e-6


@dataclass(frozen=True)
class InstanceOption:
    """One pipeline instance a fleet can be built from (units in the names).

    Attributes:
        gpu_type: catalog GPU model. cards: cards the pipeline runs on.
        rps_max: its SLO envelope, req/s. kv_capacity_tokens: its KV pool, tokens.
        price_per_card_hour: price of one card for one hour.
        gear: the planned gear (a :class:`~flexpipe_dag.core.gear.Gear`), when planned.
        timing: its stage timing model (for the simulator), when planned.
    """

    gpu_type: str
    cards: int
    rps_max: float
    kv_capacity_tokens: int
    price_per_card_hour: float
    gear: Any = field(default=None, compare=False, repr=False)
    timing: Any = field(default=None, compare=False, repr=False)

    @property
    def cost_per_hour(self) -> float:
        """Price of the whole instance for one hour."""
        return self.cards * self.price_per_card_hour


@dataclass(frozen=True)
class Mix:
    """A chosen set of instances: ``instances`` pairs each option with how many of it run."""

    instances: list[tuple[InstanceOption, int]]
    reserve_fraction: float

    @property
    def cards(self) -> int:
        return sum(o.cards * k for o, k in self.instances)

    @property
    def cost_per_hour(self) -> float:
        return sum(o.cost_per_hour * k for o, k in self.instances)

    @property
    def rps_max(self) -> float:
        """Summed SLO envelope of all instances, req/s."""
        return sum(o.rps_max * k for o, k in self.instances)

    @property
    def rps_with_reserve(self) -> float:
        """What the mix is planned to carry: ``rps_max x (1 - reserve)``."""
        return self.rps_max * (1.0 - self.reserve_fraction)

    @property
    def kv_capacity_tokens(self) -> int:
        return sum(o.kv_capacity_tokens * k for o, k in self.instances)

    def cards_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o, k in self.instances:
            out[o.gpu_type] = out.get(o.gpu_type, 0) + o.cards * k
        return out


def _milp(cost: np.ndarray, rows: np.ndarray, lower: np.ndarray, upper: np.ndarray,
          ub: np.ndarray) -> np.ndarray | None:
    """Integer ``x`` in ``[0, ub]`` minimising ``cost @ x`` with ``lower <= rows @ x <= upper``, or None."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    res = milp(c=cost, constraints=LinearConstraint(rows, lower, upper), integrality=np.ones_like(cost),
               bounds=Bounds(np.zeros_like(ub), ub))
    if not res.success or res.x is None:
        return None
    return np.asarray(np.round(res.x), dtype=np.int64)


def _usable(options: Sequence[InstanceOption]) -> list[InstanceOption]:
    for o in options:
        if o.cards < 1 or not math.isfinite(o.rps_max) or o.rps_max < 0 or o.kv_capacity_tokens < 0 \
                or not (math.isfinite(o.price_per_card_hour) and o.price_per_card_hour > 0):
            raise InputError(o.gpu_type, "instance option", f"expected cards >= 1, rps_max >= 0, KV >= 0 and a "
                                                            f"price > 0, got {o}")
    return [o for o in options if o.rps_max > 0 and o.kv_capacity_tokens > 0]


def cheapest_mix(options: Sequence[InstanceOption], *, load_rps: float, kv_need_tokens: int,
                 reserve_fraction: float) -> Mix | None:
    """The cheapest set of instances carrying ``load_rps`` with the reserve and holding ``kv_need_tokens``.

    An instance's KV pool counts toward ``kv_need_tokens`` only up to what its own share of the load
    keeps in flight (``kv_need_tokens / load_rps`` per req/s it carries): KV on a pipeline that
    carries almost nothing holds none of the others' sequences.

    Args:
        options: instance options (see the module docstring); those with no envelope are skipped.
        load_rps: load to carry, req/s (> 0). kv_need_tokens: KV tokens in flight at the P95 context.
        reserve_fraction: each instance is loaded to at most ``1 - reserve_fraction`` of its envelope.

    Returns:
        The optimal :class:`Mix`, or None when no option can serve at all.

    Raises:
        InputError: a malformed option.
    """
    usable = _usable(options)
    if not usable:
        return None
    share = 1.0 - reserve_fraction
    rps = np.array([o.rps_max * share for o in usable])
    # an instance's KV counts only up to what its own share of the load keeps in flight (kv_need per
    # req/s x the rate it carries): a pipeline that carries almost nothing cannot hold the others' sequences
    kv_per_rps = kv_need_tokens / load_rps if load_rps > 0 else 0.0
    kv = np.array([min(float(o.kv_capacity_tokens), r * kv_per_rps) if kv_per_rps else float(o.kv_capacity_tokens)
                   for o, r in zip(usable, rps)])
    # costs in units of the cheapest card-hour: the solve is the same at any price scale (at 1e-12 USD the solver's
    # tolerances swallowed the costs and the fewest-cards tie-break with them: 610 cards for what 60 carry)
    cheapest = min(o.price_per_card_hour for o in usable)
    per_hour = np.array([o.cost_per_hour / cheapest for o in usable])
    n = np.array([float(o.cards) for o in usable])
    cost = per_hour + CARD_TIE_WEIGHT * n
    ub = np.array([math.ceil(load_rps / r) + (math.ceil(kv_need_tokens / k) if k > 0 else 0) for r, k in zip(rps, kv)],
                  dtype=float)
    x = _milp(cost, np.vstack([rps, kv]), np.array([load_rps, float(kv_need_tokens)]), np.full(2, np.inf), ub)
    if x is None:
        return None
    # among the sets of that cost and card count, the one with the most SLO capacity (2 x 1 A100 over 1 x 2
    # A100: the same cards and price, more req/s): a second, exact solve, not a weight the first one's
    # optimality gap could swallow
    best_cost, best_cards = float(per_hour @ x), float(n @ x)
    roomier = _milp(-rps, np.vstack([rps, kv, per_hour, n]),
                    np.array([load_rps, float(kv_need_tokens), -np.inf, -np.inf]),
                    np.array([np.inf, np.inf, best_cost * (1 + 1e-9) + 1e-9, best_cards]), ub)
    if roomier is not None and float(rps @ roomier) > float(rps @ x):
        x = roomier
    return Mix([(o, int(k)) for o, k in zip(usable, x) if k > 0], reserve_fraction)


def max_rps_within(options: Sequence[InstanceOption], *, cards: int, kv_need_tokens: int,
                   reserve_fraction: float) -> Mix | None:
    """The instances on at most ``cards`` cards with the highest summed envelope that hold ``kv_need_tokens``.

    Returns:
        The :class:`Mix`, or None when no instance set on that many cards holds the KV need.
    """
    usable = _usable(options)
    if not usable or cards < 1:
        return None
    n = np.array([float(o.cards) for o in usable])
    kv = np.array([float(o.kv_capacity_tokens) for o in usable])
    cost = -np.array([o.rps_max for o in usable]) + CARD_TIE_WEIGHT * n
    ub = np.floor(cards / n)
    x = _milp(cost, np.vstack([n, kv]), np.array([0.0, float(kv_need_tokens)]), np.array([float(cards), np.inf]), ub)
    if x is None or not x.any():
        return None
    return Mix([(o, int(k)) for o, k in zip(usable, x) if k > 0], reserve_fraction)
