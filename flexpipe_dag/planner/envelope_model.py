"""The analytic SLO envelope of a pipeline plan under continuous batching (a fixed point; what a gear promises
before the simulator measures it).

The planner's search ranks thousands of plans with the fast closed form of
:mod:`~flexpipe_dag.planner.estimate`; this model, ~5 ms a plan, prices only the gears it proposes
(:func:`~flexpipe_dag.planner.gears.to_gear`), and is where probing of the measured envelope starts.


The serving model is the simulator's (:mod:`flexpipe_dag.sim.engine`) and the runtime's: ``M`` micro-batch
*slots* (:func:`inflight_micro_batches`) of up to ``b`` sequences cycle through the ``S`` stages
(iteration-level scheduling, Orca, Yu et al. OSDI'22; pipeline "virtual engines" as vLLM). Each
iteration of a slot decodes one token for each of its ``n`` running sequences and prefills the
prompts that joined it; stage ``s`` (``r_s`` replicas) serves one iteration at a time per replica,
FIFO. A sequence's TPOT is therefore its slot's *cycle time* ``T``.

Per offered rate ``lambda`` (req/ms) the estimate is the fixed point of (means; ``P`` prompt,
``O`` output tokens, ``C`` decode context per sequence):

* **slot occupancy.** By Little's law ``N = lambda O T`` sequences decode at once, spread over
  ``M_a = M (1 - exp(-N / M))`` active slots (Poisson occupancy; idle slots wake on arrival), so a
  slot holds ``n = N / M_a`` sequences, not ``b``. A decode step is weight-bound: its time is
  ``d_s(n) = d_s(1) + (d_s(b) - d_s(1)) (n - 1) / (b - 1)`` (the roofline is linear in ``n`` over
  ``1..b``), i.e. at low occupancy a step costs nearly as much as a full one.
* **prefill interference.** A sequence joins once in its ``O`` iterations, so an iteration carries
  ``k = n / O`` prompts on average (Poisson), whole prompts as the simulator does (no chunking;
  Sarathi-Serve, Agrawal et al. OSDI'24, shows why whole prefills stall the decodes batched with them).
  Stage service per iteration ``t_s = d_s(n) + k p_s(P)``, with second moment
  ``E t_s^2 = d^2 + 2 d k p + k E[p^2] + k^2 p^2`` (``E[p^2] = p^2 (1 + cv_P^2)``).
* **round trip with stage queueing.** The slots form a closed cyclic network of ``M_a`` customers
  over the ``S`` FIFO stations plus the link delays ``Z``. Its cycle time ``T`` comes from
  Schweitzer's approximate mean value analysis (Reiser & Lavenberg, JACM 1980; Schweitzer 1979)
  with the residual-service correction for non-exponential FCFS service (Lazowska et al.,
  *Quantitative System Performance*, 1984, Sec. 9.3.1): an iteration arriving at stage ``s`` waits
  for ``(M_a - 1)/M_a`` of the queue it sees, the one in service for its residual
  ``E t_s^2 / (2 E t_s)``. A stage with ``r_s`` replicas is Seidmann's single server of service
  ``t_s / r_s`` plus a delay of ``t_s (r_s - 1) / r_s`` (Seidmann, Schweitzer, Shalev-Oren 1987).
  The long prefill-carrying iterations hold each stage in turn and convoy the slots behind them,
  which is what makes a deep pipeline's TPOT several times its pure decode round trip.
* **stability.** ``T`` grows with ``n`` and ``n`` with ``T``; above the stable rate the loop has no
  fixed point with ``n <= b_eff`` (``b_eff = min(b, KV pool / (M (P + O)))``): slots fill and the
  waiting queue grows without bound. Capacity ``X = min_s r_s / (p_s + O d_s(b_eff) / b_eff)``.
* **TTFT.** Wait for the next slot launch (``T / 2M``), the launching iteration's round trip ``T``
  plus the request's own prefill through every stage and link, plus the admission queue. A request
  waits for admission only when all ``c = M b_eff`` seats (places in the slots) are taken; a seat is
  held ``S = O T``. The queue is G/G/c by Allen-Cunneen: the M/M/c figures at offered load
  ``a = lambda S`` scaled by ``v = (c_a^2 + c_s^2) / 2`` with ``c_s^2 = 1`` (near-exponential output
  lengths): mean ``W = v C(c, a) / (c / S - lambda)``, tail ``P(W > t) = C(c, a) exp(-(c / S -
  lambda) t / v)``, ``C`` Erlang's C formula (Allen, *Probability, Statistics and Queueing Theory*,
  1990, Sec. 6.4; Kleinrock 1975, Vol. 1, Sec. 3.5). (A G/G/1 on the busiest stage's busy share,
  used before, read about 1 on a one-stage pipeline at any load: a closed loop of decode
  iterations keeps its one stage busy.) The tail figure takes the attainment quantile of the prompt,
  ``P (1 + z_q cv_P)`` (at most the planned P95 context), as the prompt.
* **TPOT tail.** A request's TPOT averages its ``o`` cycles; a cycle is long when a prefill
  convoy passes, with standard deviation ``sigma_c = sum_s sigma(t_s) sqrt(1 + Q_s)`` (the convoy
  makes the stages' delays add coherently, not in quadrature). The ``q`` quantile over requests
  uses the short requests that dominate it: ``TPOT_q = T + z_q sigma_c / sqrt(o_min)`` with
  ``o_min = max(1, 0.1 O)`` (the 10th percentile of an exponential output length).

**SLO envelope** (``rps_at_envelope``): the highest ``lambda`` at which the fixed point exists,
``TTFT_q <= slo_ttft_ms`` and ``TPOT_q <= slo_tpot_ms`` (``q`` = ``slo_attainment``), found on a grid
of 24 rates up to the capacity (all rates solved at once as arrays, 40 damped iterations,
O(stages) work per rate) and refined by linear interpolation of the binding margin. This is the
"goodput" notion of DistServe (Zhong et al. OSDI'24): the rate served within the SLO, not the
saturation throughput. :func:`flexpipe_dag.planner.envelope.measure_envelope` measures the same
quantity by simulation; ``bench/estimate_fidelity.py`` compares the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flexpipe_dag.planner.estimate import PlanEstimate, inflight_micro_batches
from flexpipe_dag.planner.search import FIRST, LAST, MIDDLE, SINGLE, PipelinePlan, PipelineSearch

#: Grid of offered rates (as fractions of capacity) solved at once for the envelope.
_GRID = 24
#: Damped fixed-point iterations per solve (converges to < 0.1 % on the bundled fleets).
_ITERATIONS = 40
#: Short requests dominate the TPOT tail: the 10th percentile of an exponential output length.
_SHORT_OUTPUT_SHARE = 0.1


def _z(q: float) -> float:
    """Standard normal quantile (Acklam-free: bisection on erf, called once per estimate)."""
    lo, hi = -8.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _erlang_c(c: int, a: np.ndarray) -> np.ndarray:
    """Erlang C: the chance an arrival waits in M/M/c with ``c`` servers at offered load ``a`` (erlangs,
    array); 1 where ``a >= c``. Erlang B by its stable recursion ``B_k = a B_{k-1} / (k + a B_{k-1})``,
    then ``C = B / (1 - (a / c)(1 - B))`` (Kleinrock 1975, Vol. 1, Sec. 3.5). O(c) per rate."""
    b = np.ones_like(a)
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = b / (1 - (a / c) * (1 - b))
    return np.where(a >= c, 1.0, np.clip(out, 0.0, 1.0))


@dataclass(frozen=True)
class _Inputs:
    """Per-stage figures of one plan (ms), arrays of shape ``(S,)``."""

    r: np.ndarray
    d1: np.ndarray
    slope: np.ndarray
    pf: np.ndarray
    pf95: np.ndarray
    link_lat: float
    link_tok: float
    b_eff: float
    slots: int
    prompt: float
    out: float
    cv2: float
    ca2: float
    slo_ttft_ms: float


@dataclass(frozen=True)
class _Point:
    """Solved operating points (arrays over offered rates)."""

    ok: np.ndarray
    tpot: np.ndarray
    tpot_q: np.ndarray
    ttft: np.ndarray
    ttft_q: np.ndarray


def _inputs(search: PipelineSearch, plan: PipelinePlan) -> _Inputs:
    w, cm = search.workload, search.cm
    b = plan.micro_batch_size
    S = plan.num_stages
    roles = [SINGLE] if S == 1 else [FIRST] + [MIDDLE] * (S - 2) + [LAST]
    ctx = int(round(w.decode_context_mean_tokens))
    r, d1, db, pf, pf95, kv_tokens = [], [], [], [], [], []
    # the attainment quantile of the prompt (mean + z cv mean), at most the planned P95 context
    prompt_q = int(min(w.context_p95_tokens, round(w.prompt_tokens_mean * (1 + _z(w.slo_attainment) * w.prompt_tokens_cv))))
    kv_token_layer = search.model.kv_bytes_per_token_per_layer(cm.dtype)
    ws = max(b, w.prefill_chunk_tokens) * search.model.activation_workspace_bytes_per_token(cm.dtype)
    for ds, k, role in zip(plan.device_ids, plan.sizes, roles):
        first, last = role in (FIRST, SINGLE), role in (LAST, SINGLE)
        t = search.tables(ds[0], b, len(ds))
        r.append(float(len(ds)))
        db.append(float(t.decode_ms[role, k]))
        d1.append(cm.stage_decode_ms(ds[0], k, first, last, 1, ctx))
        pf.append(float(t.prefill_ms[role, k]))
        pf95.append(cm.stage_prefill_ms(ds[0], k, first, last, prompt_q))
        weight = search.model.stage_weight_bytes(k, first, last, cm.dtype)
        kv_tokens.append(max(0.0, (t.usable_bytes - weight - ws) // (kv_token_layer * k)) * len(ds))
    hops = [(a[0], c[0]) for a, c in zip(plan.device_ids, plan.device_ids[1:])]
    lat = sum(cm.transfer_ms(a, c, 1) for a, c in hops)
    big = max(2, w.prompt_tokens_mean)
    tok = sum((cm.transfer_ms(a, c, big) - cm.transfer_ms(a, c, 1)) / (big - 1) for a, c in hops)
    slots = inflight_micro_batches(plan, w.concurrency)
    per_seq = w.prompt_tokens_mean + w.output_tokens_mean
    b_eff = max(1.0, min(float(b), min(kv_tokens) / per_seq / slots)) if kv_tokens else float(b)
    d1a, dba = np.array(d1), np.array(db)
    slope = (dba - d1a) / (b - 1) if b > 1 else np.zeros(S)
    return _Inputs(np.array(r), d1a, slope, np.array(pf), np.array(pf95), lat, tok, b_eff, slots,
                   float(w.prompt_tokens_mean), float(w.output_tokens_mean), w.prompt_tokens_cv ** 2, w.arrival_scv, w.slo_ttft_ms)


def _capacity_per_ms(x: _Inputs) -> float:
    """Stable rate (req/ms) with slots at ``b_eff``: ``min_s r_s / (p_s + O d_s(b_eff) / b_eff)``."""
    d = x.d1 + x.slope * (x.b_eff - 1)
    return float(np.min(x.r / (x.pf + x.out * d / x.b_eff)))


def _convoy_stall(x: _Inputs, lam: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean delay per cycle behind prefill-carrying iterations, and per-stage blocking probability.

    Stages are FIFO and iterations never overtake (a tandem line), so a slot that queues behind a
    prefill at stage ``s`` stays behind it downstream: there it waits the carrier's whole prefill
    less its own previous service, not a fresh residual. With ``u_s`` the chance that all ``r_s``
    replicas of stage ``s`` are busy with prefill (``(lambda p_s / r_s) ** r_s``) and ``c_s`` the
    chance the slot is in a convoy after stage ``s``::

        stall_s = (1 - c_{s-1}) u_s E[p_s^2] / (2 p_s) + c_{s-1} max(0, p_s - d_{s-1})
        c_s     = c_{s-1} + (1 - c_{s-1}) u_s

    The coherent (second) part is stretched by ``1 / (1 - rho_c)``, ``rho_c = sum_s u_s``: prompts
    arriving while a convoy travels join it, as in an M/G/1 busy period (Kleinrock 1975, Sec. 5.8).
    O(stages); arrays ``(G, S)``.
    """
    G, S = d.shape
    u = np.minimum((lam[:, None] * x.pf / x.r[None, :]) ** x.r[None, :], 0.999)
    res = x.pf * (1 + x.cv2) / 2
    c = np.zeros(G)
    first = np.zeros(G)
    coherent = np.zeros(G)
    for s in range(S):
        cont = np.maximum(0.0, x.pf[s] - d[:, s - 1]) if s else np.zeros(G)
        first += (1 - c) * u[:, s] * res[s]
        coherent += c * cont
        c = c + (1 - c) * u[:, s]
    # a convoy grows while it travels (prompts arriving meanwhile join behind it): the coherent part
    # is the M/G/1 busy-period stretch 1 / (1 - rho_c), rho_c the prefill occupancy of the line
    rho_c = np.minimum(np.sum(u, axis=1), 0.95)
    return first + coherent / (1 - rho_c), u


def _solve(x: _Inputs, lam: np.ndarray, q: float) -> _Point:
    """Fixed point of the module docstring at offered rates ``lam`` (req/ms), all at once."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _solve_arrays(x, lam, q)


def _solve_arrays(x: _Inputs, lam: np.ndarray, q: float) -> _Point:
    G = lam.shape[0]
    M = float(x.slots)
    r = x.r[None, :]
    ep2 = x.pf ** 2 * (1 + x.cv2)
    T = np.full(G, float(np.sum(x.d1) + x.link_lat))
    Q = np.zeros((G, x.r.shape[0]))
    over = np.zeros(G, dtype=bool)
    for _ in range(_ITERATIONS):
        N = lam * x.out * T
        Ma = np.clip(N, 1.0, M)
        n = np.maximum(1.0, N / Ma)
        over = n > x.b_eff * (1 + 1e-9)
        n = np.minimum(n, x.b_eff)
        k = (n / x.out)[:, None]
        d = x.d1 + x.slope * (n[:, None] - 1)
        t = d + k * x.pf
        X = (Ma / T)[:, None]
        U = np.minimum(X * t / r, 0.999)
        # decode-only queueing among the slots (Schweitzer AMVA, Seidmann multi-server)
        share = ((Ma - 1) / Ma)[:, None]
        wait = share * np.maximum(Q - U, 0.0) * d / r + share * U * d / (2 * r)
        Q = X * wait + U
        stall, u = _convoy_stall(x, lam, d)
        trip = np.sum(d + wait, axis=1) + x.link_lat + x.link_tok * (n + k[:, 0] * x.prompt) + stall
        Tn = np.maximum(trip, np.max(Ma[:, None] * t / r, axis=1))
        T = 0.5 * T + 0.5 * Tn
    et2 = d * d + 2 * d * k * x.pf + k * ep2 + k * k * x.pf ** 2
    # admission: a request waits only when every one of the c = M b_eff seats (slot places) is taken;
    # a seat is held O cycles, S = O T. G/G/c by Allen-Cunneen: the M/M/c wait (Erlang C) scaled by
    # (c_a^2 + c_s^2) / 2, c_s^2 = 1 (output lengths are near-exponential) (Allen, *Probability,
    # Statistics and Queueing Theory*, 1990, Sec. 6.4)
    seats = max(1, int(round(M * x.b_eff)))
    hold = x.out * T
    offered = lam * hold
    p_wait = _erlang_c(seats, offered)
    v = (x.ca2 + 1.0) / 2
    drain = np.maximum(seats / hold - lam, 1e-12)  # per ms
    W = v * p_wait / drain
    tail = np.where(p_wait > 1 - q, v / drain * np.log(np.maximum(p_wait, 1e-300) / (1 - q)), 0.0)
    # the number in flight fluctuates (Poisson-like, variance inflated by the burstiness ca2); the
    # slots overflow into the waiting queue when it exceeds M b_eff, and a backlog of more than
    # lambda x (TTFT slack) requests breaks the TTFT SLO
    N = lam * x.out * T
    slack = lam * np.maximum(x.slo_ttft_ms - (T / (2 * M) + np.sum(d, axis=1) + np.sum(x.pf)), 0.0)
    stable = ~over & (N + _z(q) * np.sqrt(x.ca2 * N) <= M * x.b_eff + slack)
    # prompts that arrive while the slot waits to launch share its iteration (index of dispersion ca2)
    mates = lam * (T / M) * x.ca2
    own = x.link_tok * x.prompt
    base = T / (2 * M) + np.sum(d, axis=1) + x.link_lat + stall + mates * np.sum(x.pf)
    ttft = base + np.sum(x.pf) + own + W
    ttft_q = base + np.sum(x.pf95) + own * np.sum(x.pf95) / max(float(np.sum(x.pf)), 1e-12) + tail
    sigma = np.sum(np.sqrt(np.maximum(et2 - t * t, 0.0) * u), axis=1) + np.sqrt(np.maximum(stall, 0.0) * np.max(x.pf))
    tpot_q = T + _z(q) * sigma / math.sqrt(max(1.0, _SHORT_OUTPUT_SHARE * x.out))
    return _Point(stable, T, tpot_q, ttft, ttft_q)


def estimate_envelope(search: PipelineSearch, plan: PipelinePlan, utilisation: float | None = None,
                      rps: float | None = None) -> PlanEstimate:
    """Estimate ``plan`` (formulas and sources in the module docstring).

    Args:
        utilisation: if given, the envelope is also capped at this share of the capacity.
        rps: report TTFT / TPOT at this rate (req/s, clipped to the capacity) instead of at the
            envelope; the envelope is computed either way.

    The SLO and attainment are the workload's (:class:`~flexpipe_dag.planner.workload.PlanWorkload`).
    Cost: O(stages) numpy work on a 24-rate grid, 40 iterations; no simulation.
    """
    w = search.workload
    x = _inputs(search, plan)
    q = w.slo_attainment
    cap = _capacity_per_ms(x)
    lams = cap * np.arange(1, _GRID + 1) / _GRID
    pts = _solve(x, lams, q)
    margin = np.minimum.reduce([w.slo_tpot_ms - pts.tpot_q, w.slo_ttft_ms - pts.ttft_q,
                                np.where(pts.ok, np.inf, -1.0)])
    passing = np.nonzero(margin >= 0)[0]
    if len(passing) == 0:
        low = _solve(x, np.array([cap / _GRID / 8]), q)
        ok0 = bool(low.ok[0] and low.tpot_q[0] <= w.slo_tpot_ms and low.ttft_q[0] <= w.slo_ttft_ms)
        env = cap / _GRID / 8 if ok0 else 0.0
    else:
        i = int(passing[-1])
        env = float(lams[i])
        if i + 1 < _GRID and np.isfinite(margin[i + 1]) and margin[i + 1] < 0 and pts.ok[i + 1]:
            env += float((lams[i + 1] - lams[i]) * margin[i] / (margin[i] - margin[i + 1]))
    if utilisation is not None:
        env = min(env, utilisation * cap)
    at = env if rps is None else min(rps / 1e3, cap)
    at = max(at, cap * 1e-6)
    p = _solve(x, np.array([at, cap * 1e-6]), q)
    idle_tpot = float(p.tpot[1])
    idle_ttft = float(np.sum(x.pf) + x.link_lat + x.link_tok * x.prompt)
    S = plan.num_stages
    bottleneck = max(range(S), key=lambda i: plan.stage_busy_ms[i])
    thr = cap * 1e3
    return PlanEstimate(
        throughput_rps=thr, tokens_per_s=thr * w.output_tokens_mean,
        ttft_p50_ms=float(p.ttft[0]), ttft_p99_ms=float(max(p.ttft_q[0], p.ttft[0])),
        tpot_p50_ms=float(p.tpot[0]), tpot_p99_ms=float(max(p.tpot_q[0], p.tpot[0])),
        tpot_idle_ms=idle_tpot, ttft_idle_ms=idle_ttft, bottleneck_stage=bottleneck,
        rps_at_envelope=env * 1e3)
