"""Discrete-event simulator of pipeline-parallel LLM serving with iteration-level continuous batching.

Model (one gear = one pipeline):

* **Micro-batch slots.** The pipeline keeps ``M = max_inflight_micro_batches`` slots, each holding
  up to ``B = micro_batch_size`` running sequences (as vLLM's pipeline-parallel "virtual engines").
  A slot runs one *iteration* at a time: it is scheduled, travels stage 0 -> S-1, and when the last
  stage finishes every sequence in it has one more token; then it is scheduled again at once
  (iteration-level scheduling, Orca OSDI'22). New requests join a slot's next iteration as
  *prefill* (the whole prompt; the first token comes out of prefill) next to the slot's *decode*
  sequences.
* **Stages.** Stage ``s`` has ``r_s`` replicas (servers) and a FIFO queue of micro-batches. An
  iteration's service time at stage ``s`` is ``prefill_ms(s, P, p) + decode_ms(s, n, ctx)`` (``P``
  prompt tokens of ``p`` prompts, each attending within itself; ``n`` decode sequences with ``ctx``
  context tokens in total); after stage ``s`` the
  activations take ``transfer_ms(s, P + n)`` to reach stage ``s+1`` (a delay, links are not
  contended). Times come only from the :class:`~flexpipe_dag.core.timing.StageTimingModel`.
* **Paged KV.** A pool of ``kv_capacity_tokens // kv_block_size_tokens`` blocks, at least one (vLLM
  PagedAttention, SOSP'23). Before each iteration a sequence holds blocks for
  ``input + generated + 1`` tokens; admission needs them free. When a running sequence cannot grow,
  the lowest-priority sequence of its micro-batch is preempted by *recompute*: its blocks are
  freed and it re-queues (keeping its arrival order) to prefill ``input + generated`` tokens later.
  A request whose ``input + output`` tokens exceed the whole pool is *rejected* at admission (it
  could never finish; reason ``"kv_capacity"``); nothing is ever dropped silently.
* **Context.** With ``SimConfig.max_context_tokens`` (the model's max context) a request whose
  ``input + output`` tokens exceed it is rejected at arrival (reason ``"context"``), or with
  ``context_policy="truncate"`` served with its prompt cut from the left
  (:mod:`flexpipe_dag.workload.context`, the rule the planner and the runtime apply too).
* **Priority.** The waiting queue is ordered by (online before offline, larger ``priority`` first,
  arrival, id). Optionally an online request preempts offline sequences to get KV blocks.
* **Work fed in while it runs.** :meth:`Simulator.submit` queues requests at the current simulated
  time (the serve loop's offline admission, which hands the router a bounded number of batch jobs
  in troughs); they take the same queue, priority rules and pipelines as the workload's own.
* **Gear shift with drain.** :meth:`Simulator.shift_gear` makes a new pipeline the one that
  admits; the old one admits nothing more, its running sequences finish on the old gear's timing
  (sequences it preempts go to the shared queue and the new gear). The two do not contend for
  devices during the drain (the shadow gear runs on its own capacity).

Every ``sample_period_s`` of simulated time a :class:`~flexpipe_dag.core.metrics.MetricSample`
(``source="sim"``) is emitted for the admitting gear (none with ``SimConfig.metric_samples=False``).
Its request rate, completions and latency percentiles are over online requests only (the controller
watches the online service; offline work sharing the pipeline is not its load), as the live
runtime's samples are.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypedDict, cast

import numpy as np

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.kv import kv_tokens_needed
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.sim.results import RunRecord, ShiftEvent, SimResult, build_result
from flexpipe_dag.workload.context import CONTEXT_REASON, apply_context_rule
from flexpipe_dag.workload.request import Request, Workload

_ARRIVE, _DONE, _SWITCH = 0, 1, 2
_INF = float("inf")

#: A run that emits metric samples stops with an error when a stage step would end later than the last
#: arrival + this many times the arrivals' span, or + :data:`DRAIN_FLOOR_S`, whichever is later: its samples
#: (one per ``sample_period_s``) would otherwise grow with a clock that stage times of hours or more push
#: out without bound (a timing table's coefficient of 1e300 ms ran until memory ran out). An overloaded
#: gear drains its backlog in about (offered / served rate - 1) x the span, so 10x is a gear serving at
#: under a tenth of the offered load.
DRAIN_SPAN_FACTOR = 10.0
#: The least a sampled run may go on past its last arrival, s (a day).
DRAIN_FLOOR_S = 86400.0


class DrainHorizonError(InputError):
    """A sampled run's stage step or stage-to-stage transfer would end past the drain horizon
    (:data:`DRAIN_SPAN_FACTOR`): the stage timing's figures are not a pipeline's. ``field`` names the stage
    and ``step time`` / ``transfer time``; a caller that knows the timing's file re-raises naming it."""

#: A sequence's place in the waiting queue: (0 online / 1 offline, -priority, arrival_s, request index).
_SeqKey = tuple[int, int, float, int]


class _Seq:
    __slots__ = ("idx", "key", "online", "inp", "out", "gen", "blocks", "first_s", "finish_s", "preempt", "rejected",
                 "reason", "gear_id", "pf_left")

    def __init__(self, idx: int, key: _SeqKey, online: bool, inp: int, out: int):
        self.idx = idx
        self.key = key
        self.online = online
        self.inp = inp
        self.out = out
        self.gen = 0
        self.blocks = 0
        self.first_s = -1.0
        self.finish_s = -1.0
        self.preempt = 0
        self.rejected = False
        self.reason = ""  # why it was rejected: "context" (over the model's max context) or "kv_capacity"
        self.gear_id = ""
        self.pf_left = 0  # prompt tokens (input + generated, after a preemption) still to prefill


class _Stage:
    __slots__ = ("replicas", "free", "queue", "busy_s", "busy_win")

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.free = replicas
        self.queue: deque[_MicroBatch] = deque()
        self.busy_s = 0.0  # total replica-seconds of service
        self.busy_win: dict[int, float] = {}  # window index -> replica-seconds


class _MicroBatch:
    __slots__ = ("slot", "stage", "times_s", "xfer_s", "seqs")

    def __init__(self, slot: int, times_s: list[float], xfer_s: list[float], seqs: list[_Seq]):
        self.slot = slot
        self.stage = 0
        self.times_s = times_s
        self.xfer_s = xfer_s
        self.seqs = seqs


def _kv_capacity_tokens(gear: Gear, config: SimConfig) -> int:
    if config.kv_capacity_tokens is not None:
        return config.kv_capacity_tokens
    if gear.kv_capacity_tokens:
        return gear.kv_capacity_tokens
    per_stage = [st.kv_capacity_tokens for st in gear.stages if st.kv_capacity_tokens]
    return min(per_stage) if per_stage else 0


class _Pipeline:
    """One gear's runtime state: stages, slots, KV pool."""

    def __init__(self, gear: Gear, timing: StageTimingModel, config: SimConfig):
        if timing.num_stages != gear.num_stages:
            raise InputError(gear.gear_id, "timing.num_stages",
                             f"timing model has {timing.num_stages} stages; gear has {gear.num_stages}")
        self.gear = gear
        self.gear_id = gear.gear_id
        self.timing = timing
        self.num_stages = gear.num_stages
        self.stages = [_Stage(st.replicas) for st in gear.stages]
        self.micro_batch_size = config.micro_batch_size or gear.micro_batch_size  # sequences per slot
        if config.chunked_prefill:  # a decode takes a token of the budget, as in the runtime scheduler
            self.micro_batch_size = min(self.micro_batch_size, cast(int, config.prefill_token_budget))
        n_slots = config.max_inflight_micro_batches or gear.max_inflight_micro_batches
        self.slots: list[list[_Seq]] = [[] for _ in range(n_slots)]
        self.idle: list[int] = list(range(n_slots))  # slots with nothing in flight and no sequences
        self.inflight = 0
        self.block = gear.kv_block_size_tokens
        cap_tokens = _kv_capacity_tokens(gear, config)
        # 0 = unbounded; a pool under one block is one block, as the runtime sizes it (kv_num_blocks), not
        # 0 blocks, which would read as unbounded and admit everything
        self.total_blocks = max(1, cap_tokens // self.block) if cap_tokens else 0
        self.free_blocks = self.total_blocks if self.total_blocks else 1 << 62
        self.admitting = True
        self.drained_s: float | None = None
        self._prefill = timing.prefill_ms
        self._decode = timing.decode_ms
        self._step = timing.step_ms
        self._transfer = timing.transfer_ms
        self.ctx_quantum = config.decode_context_quantum_tokens
        self._pcache: list[dict[tuple[int, int], float]] = [{} for _ in range(self.num_stages)]  # (tokens, prompts) -> ms
        self._dcache: list[dict[tuple[int, ...], float]] = [{} for _ in range(self.num_stages)]  # (seqs, ctx) -> ms
        # (stage, prompt tokens, prompts, decode seqs, ctx) -> ms of a mixed step
        self._mcache: dict[tuple[int, ...], float] = {}
        self._tcache: list[dict[int, float]] = [{} for _ in range(self.num_stages)]           # tokens -> s
        self._iter_cache: dict[tuple[int, int, int, int], tuple[list[float], list[float]]] = {}

    @property
    def used_blocks(self) -> int:
        return (self.total_blocks - self.free_blocks) if self.total_blocks else 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block)

    def iteration_times(self, prefill_tokens: int, n_decode: int, ctx_tokens: int,
                        n_prefill: int = 1) -> tuple[list[float], list[float]]:
        """Per-stage service seconds and per-hop transfer seconds of one iteration (memoised).

        ``prefill_tokens`` are the prompt tokens of ``n_prefill`` prompts (or chunks), each attending
        within itself (:meth:`~flexpipe_dag.core.timing.StageTimingModel.prefill_ms`).
        A step with both prompt and decode tokens is priced as one pass
        (:meth:`~flexpipe_dag.core.timing.StageTimingModel.step_ms`), as the runtime runs it.
        Prefill and transfer times are cached by exact token (and prompt) count. Decode and mixed
        times are cached on a grid of ``ctx_quantum`` context tokens and linearly interpolated between
        grid points (exact for costs linear in context, as in the roofline and linear models;
        ``ctx_quantum`` 0 = call the timing model every time).
        """
        key = (prefill_tokens, n_decode, ctx_tokens, n_prefill)
        hit = self._iter_cache.get(key)
        if hit is not None:
            return hit
        times: list[float] = []
        xfer: list[float] = []
        tok = prefill_tokens + n_decode
        last = self.num_stages - 1
        q = self.ctx_quantum
        for s in range(self.num_stages):
            if prefill_tokens and not n_decode:
                pc = self._pcache[s]
                ms = pc.get((prefill_tokens, n_prefill))
                if ms is None:
                    ms = pc[(prefill_tokens, n_prefill)] = self._prefill(s, prefill_tokens, n_prefill)
            elif prefill_tokens:  # a mixed step: one pass over the prompt and decode tokens
                ms = self._on_context_grid(self._mcache, (s, prefill_tokens, n_prefill, n_decode), ctx_tokens,
                                           self._step_at)
            elif q:  # decode only: the hot path, inlined
                lo = ctx_tokens - ctx_tokens % q
                dc = self._dcache[s]
                ms = dc.get((n_decode, lo))
                if ms is None:
                    ms = dc[(n_decode, lo)] = self._decode(s, n_decode, lo)
                if lo != ctx_tokens:
                    b = dc.get((n_decode, lo + q))
                    if b is None:
                        b = dc[(n_decode, lo + q)] = self._decode(s, n_decode, lo + q)
                    ms += (b - ms) * (ctx_tokens - lo) / q
            else:
                ms = self._decode(s, n_decode, ctx_tokens)
            times.append(ms / 1000.0)
            if s < last:
                tc = self._tcache[s]
                v = tc.get(tok)
                if v is None:
                    v = tc[tok] = self._transfer(s, tok) / 1000.0
                xfer.append(v)
            else:
                xfer.append(0.0)
        out = (times, xfer)
        if not n_decode:
            self._iter_cache[key] = out
        return out

    def _step_at(self, key: tuple[int, ...], ctx_tokens: int) -> float:
        """The mixed step ``key`` = (stage, prompt tokens, prompts, decode sequences) at ``ctx_tokens``."""
        s, prefill_tokens, n_prefill, n_decode = key
        return float(self._step(s, prefill_tokens, n_prefill, n_decode, ctx_tokens))

    def _on_context_grid(self, cache: dict[tuple[int, ...], float], head: tuple[int, ...], ctx_tokens: int,
                         price: Callable[[tuple[int, ...], int], float]) -> float:
        """``price(head, ctx_tokens)`` from memoised points on a grid of ``ctx_quantum`` context tokens,
        linearly interpolated between them (``ctx_quantum`` 0: priced every time)."""
        q = self.ctx_quantum
        if not q:
            return price(head, ctx_tokens)
        lo = ctx_tokens - ctx_tokens % q
        a = cache.get(head + (lo,))
        if a is None:
            a = cache[head + (lo,)] = price(head, lo)
        if lo == ctx_tokens:
            return a
        b = cache.get(head + (lo + q,))
        if b is None:
            b = cache[head + (lo + q,)] = price(head, lo + q)
        return a + (b - a) * (ctx_tokens - lo) / q


#: A queued event: (time_s, tie-break counter, kind, pipeline, micro-batch or switch-request time).
_Event = tuple[float, int, int, _Pipeline, _MicroBatch | float]


class _Window:
    """What happened in one sample window: online arrivals, completions, tokens and latencies (seconds)."""

    __slots__ = ("arrivals", "completed", "e2e_s", "tokens", "tpot_s", "ttft_s")

    def __init__(self) -> None:
        self.arrivals = 0
        self.completed = 0
        self.tokens = 0
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []
        self.e2e_s: list[float] = []


class _ShiftRecord(TypedDict):
    """A shift as the simulator tracks it (``_pipe``: the old pipeline, to mark when it drained)."""

    requested_s: float
    switched_s: float
    from_gear_id: str
    to_gear_id: str
    drained_s: float | None
    _pipe: _Pipeline


class Simulator:
    """Step-able discrete-event simulation of a workload served by a gear (see module docstring).

    Usage::

        sim = Simulator(workload, gear, timing, SimConfig())
        while not sim.finished:
            for sample in sim.advance(sim.now_s + 2.0):
                ...                                  # a controller reads samples
            if want_shift: sim.shift_gear(new_gear, new_timing)
        result = sim.result()

    or simply ``Simulator(...).run()``. Deterministic: no randomness, ties broken by request order.

    Requests over ``config.max_context_tokens`` are rejected at arrival (or, with
    ``context_policy="truncate"``, simulated truncated; :attr:`workload` then holds the truncated
    lengths); :attr:`context` counts them.

    Raises:
        InputError: the timing model's stage count differs from the gear's; an arrival is not finite or
            is later than :data:`~flexpipe_dag.workload.request.MAX_ARRIVAL_S` (the request named).
    """

    def __init__(self, workload: Workload, gear: Gear, timing: StageTimingModel, config: SimConfig | None = None):
        self.config = config or SimConfig()
        rule = apply_context_rule(workload, self.config.max_context_tokens, self.config.context_policy)
        self.context = rule.report
        if rule.truncated_ids:
            workload = rule.workload  # same requests, same order, long prompts cut
        workload.check_horizon()
        self.workload = workload
        reqs = workload.requests
        self._seqs = [
            _Seq(i, (0 if r.klass == "online" else 1, -r.priority, r.arrival_s, i), r.klass == "online", r.input_tokens, r.output_tokens)
            for i, r in enumerate(reqs)
        ]
        refused = set(rule.report.refused_ids)
        if refused:
            for s, r in zip(self._seqs, reqs):
                if r.request_id in refused:
                    s.rejected, s.reason = True, CONTEXT_REASON
        self._truncated = [r.request_id in rule.truncated_ids for r in reqs]
        self._arrival_s = [r.arrival_s for r in reqs]
        self._next_arrival = 0
        self._n_arrivals = len(reqs)  # requests the arrival loop releases; submitted ones go straight to the queue
        self._submitted: list[Request] = []
        self._ids = {r.request_id for r in reqs}
        self._offline_open = 0  # offline requests queued or running (submitted or arrived), not finished or refused
        self._heap: list[_Event] = []
        self._counter = 0
        self._waiting: list[tuple[_SeqKey, _Seq]] = []  # heap of (key, seq)
        self._running = 0
        self.now_s = 0.0
        self._active = _Pipeline(gear, timing, self.config)
        self._draining: list[_Pipeline] = []
        self._pipes = [self._active]
        self.shifts: list[_ShiftRecord] = []
        self.samples: list[MetricSample] = []
        self._period = self.config.sample_period_s
        self._sampling = self.config.metric_samples
        self._next_tick = 1
        self._win: dict[int, _Window] = {}  # window index -> what happened in it
        self._pending_switch = 0
        self._last_event_s = 0.0
        self._arrival_span_s = (min(self._arrival_s, default=0.0), max(self._arrival_s, default=0.0))
        self._horizon_s = self._drain_horizon_s()

    # ------------------------------------------------------------------ public API
    @property
    def finished(self) -> bool:
        """True when every request has arrived and finished (or was rejected)."""
        return (self._next_arrival >= self._n_arrivals and not self._heap and not self._waiting
                and self._running == 0 and not self._pending_switch)

    @property
    def gear_id(self) -> str:
        """The gear that admits new requests now."""
        return self._active.gear_id

    def shift_gear(self, gear: Gear, timing: StageTimingModel, *, ready_in_s: float = 0.0) -> None:
        """Switch admissions to ``gear`` after ``ready_in_s`` simulated seconds (shadow warm-up).

        Until then the current gear keeps admitting; afterwards it drains (running sequences finish
        on its timing) while the new gear takes every new and queued request. No request is lost.

        Raises:
            InputError: ``ready_in_s`` < 0 or the timing model does not match the gear.
        """
        if ready_in_s < 0:
            raise InputError(gear.gear_id, "ready_in_s", f"got {ready_in_s}; expected >= 0")
        pipe = _Pipeline(gear, timing, self.config)
        self._pending_switch += 1
        self._push(self.now_s + ready_in_s, _SWITCH, pipe, self.now_s)

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue ``requests`` now (``now_s``), as the serve loop hands batch work to a running pipeline.

        Each takes the waiting queue by its class and priority (online before offline), under the
        config's context rule; a request the rule refuses is rejected at once. The result lists them
        after the workload's requests, with ``arrival_s`` = the time they were submitted.

        Raises:
            InputError: a request id already in this simulation.
        """
        if not requests:
            return
        batch = Workload(name="submitted", requests=tuple(requests))
        rule = apply_context_rule(batch, self.config.max_context_tokens, self.config.context_policy)
        refused = set(rule.report.refused_ids)
        served = {r.request_id: r for r in rule.workload.requests}
        t = self.now_s
        for r in requests:
            if r.request_id in self._ids:
                raise InputError("submitted requests", f"request {r.request_id}.request_id",
                                 "already in this simulation; expected a new id")
            self._ids.add(r.request_id)
            r = served.get(r.request_id, r)
            idx = len(self._seqs)
            s = _Seq(idx, (0 if r.klass == "online" else 1, -r.priority, t, idx), r.klass == "online",
                     r.input_tokens, r.output_tokens)
            self._seqs.append(s)
            self._arrival_s.append(t)
            self._truncated.append(r.request_id in rule.truncated_ids)
            self._submitted.append(r)
            if r.request_id in refused:
                s.rejected, s.reason, s.gear_id = True, CONTEXT_REASON, self._active.gear_id
                continue
            self._offline_open += not s.online
            heapq.heappush(self._waiting, (s.key, s))
        first, last = self._arrival_span_s
        self._arrival_span_s = (min(first, t), max(last, t))
        self._horizon_s = self._drain_horizon_s()
        self._wake(self._active, t)

    @property
    def open_requests(self) -> int:
        """Requests in the system now (arrived or submitted): waiting in the queue or running, not finished."""
        return len(self._waiting) + self._running

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the admitting gear's KV pool holds (0: unbounded); a request needing more is never admitted."""
        return self._active.total_blocks * self._active.block

    @property
    def offline_open(self) -> int:
        """Offline requests in the system now: queued or running, not finished or refused."""
        return self._offline_open

    def advance(self, until_s: float) -> list[MetricSample]:
        """Simulate up to ``until_s`` (inclusive) and return the metric samples emitted on the way."""
        first_new = len(self.samples)
        self._loop(until_s)
        if until_s != _INF:
            self.now_s = max(self.now_s, until_s)
            if self._sampling:
                self._emit_until(until_s)
        return self.samples[first_new:]

    def slo_outcome_so_far(self, first_index: int = 0) -> tuple[int, int]:
        """``(certain_misses, rejected)`` among requests ``first_index..`` at the current simulated time.

        A request is a *certain* miss of the SLO (``config.slo_ttft_ms`` / ``slo_tpot_ms``, the same
        rule as :func:`~flexpipe_dag.sim.results.build_result`'s ``slo_met``) once nothing simulated
        later can rescue it: it was rejected; or its TTFT is, or has already grown, past
        ``slo_ttft_ms`` (first token late, or still none ``slo_ttft_ms`` after arrival); or its TPOT,
        ``(finish - first) / (out - 1)``, is already past ``slo_tpot_ms`` given that it has not
        finished by now. Envelope probes use it to stop a simulation whose verdict is already clear
        (:func:`flexpipe_dag.planner.envelope.probe_gear`). ``rejected`` counts every request, from 0.

        Cost: one pass over the requests (O(n)).
        """
        now = self.now_s
        eps = 1e-9  # only a clear miss counts: the final rule compares in ms, rounded differently
        ttft_s = self.config.slo_ttft_ms / 1000.0 + eps
        tpot_s = self.config.slo_tpot_ms / 1000.0
        arrival = self._arrival_s
        misses = 0
        rejected = 0
        for i, s in enumerate(self._seqs):
            if s.rejected:
                rejected += 1
                misses += i >= first_index
                continue
            if i < first_index or i >= self._next_arrival:
                continue
            a = arrival[i]
            if s.first_s < 0.0:
                misses += now - a > ttft_s
            elif s.first_s - a > ttft_s:
                misses += 1
            elif s.out > 1:
                end = s.finish_s if s.finish_s >= 0.0 else now
                misses += end - s.first_s > tpot_s * (s.out - 1) + eps
        return misses, rejected

    def run(self) -> SimResult:
        """Simulate to the end and return the :class:`~flexpipe_dag.sim.results.SimResult`."""
        self.advance(_INF)
        return self.result()

    def result(self) -> SimResult:
        """Per-request results, samples, shifts and summary of what has been simulated so far."""
        if self._sampling and (self._last_event_s > 0.0 or self._seqs):
            # the window holding the last event, [k p, (k+1) p), is reported at tick (k+1) p
            self._emit_until((int(self._last_event_s // self._period) + 1) * self._period)
        stage_busy: dict[str, list[float]] = {}
        for p in self._pipes:
            prev = stage_busy.get(p.gear_id, [0.0] * p.num_stages)
            stage_busy[p.gear_id] = [a + st.busy_s / st.replicas for a, st in zip(prev, p.stages)]
        seqs = self._seqs
        workload = self.workload
        if self._submitted:  # the workload's requests, then the submitted ones, in the order of ``seqs``
            workload = Workload(name=workload.name, requests=workload.requests + tuple(self._submitted),
                                source=workload.source, meta=workload.meta)
        return build_result(RunRecord(
            workload=workload, config=self.config, arrival_s=self._arrival_s,
            first_token_s=[s.first_s for s in seqs], finish_s=[s.finish_s for s in seqs],
            preemptions=[s.preempt for s in seqs], rejected=[s.rejected for s in seqs],
            gear_ids=[s.gear_id for s in seqs], stage_busy_s=stage_busy, samples=self.samples,
            shifts=self.shift_events(), first_gear_id=self._pipes[0].gear_id, final_gear_id=self.gear_id,
            reject_reasons=[s.reason for s in seqs], context_truncated=self._truncated, context=self.context))

    # ------------------------------------------------------------------ event loop
    def _push(self, t: float, kind: int, pipe: _Pipeline, payload: _MicroBatch | float) -> None:
        """Queue an event: ``_ARRIVE`` / ``_DONE`` carry a micro-batch, ``_SWITCH`` the time it was requested."""
        self._counter += 1
        heapq.heappush(self._heap, (t, self._counter, kind, pipe, payload))

    def _loop(self, until_s: float) -> None:
        heap = self._heap
        arr = self._arrival_s
        n = self._n_arrivals
        seqs = self._seqs
        waiting = self._waiting
        period = self._period
        sampling = self._sampling
        while True:
            t_ev = heap[0][0] if heap else _INF
            t_arr = arr[self._next_arrival] if self._next_arrival < n else _INF
            t = t_arr if t_arr <= t_ev else t_ev
            if t > until_s or t == _INF:
                return
            if sampling and t >= self._next_tick * period:
                self._emit_until(t, strictly_before=True)
            self.now_s = t
            self._last_event_s = t
            if t_arr <= t_ev:
                w = self._window(t) if sampling else None
                while self._next_arrival < n and arr[self._next_arrival] == t:
                    s = seqs[self._next_arrival]
                    if s.rejected:  # over the model's max context: refused at arrival
                        s.gear_id = self._active.gear_id
                    else:
                        heapq.heappush(waiting, (s.key, s))
                        self._offline_open += not s.online
                    self._next_arrival += 1
                    if w is not None and s.online:  # rps counts online arrivals only (core.metrics.RPS_DEFINITION)
                        w.arrivals += 1
                self._wake(self._active, t)
                continue
            _, _, kind, pipe, payload = heapq.heappop(heap)
            if kind == _DONE:
                self._stage_done(pipe, cast(_MicroBatch, payload), t)
            elif kind == _ARRIVE:
                self._stage_arrive(pipe, cast(_MicroBatch, payload), t)
            else:
                self._switch(pipe, cast(float, payload), t)

    def _window(self, t: float) -> _Window:
        k = int(t // self._period)
        w = self._win.get(k)
        if w is None:
            w = self._win[k] = _Window()
        return w

    # ------------------------------------------------------------------ stages
    def _stage_arrive(self, pipe: _Pipeline, mb: _MicroBatch, t: float) -> None:
        st = pipe.stages[mb.stage]
        if st.free:
            st.free -= 1
            self._serve(pipe, st, mb, t)
        else:
            st.queue.append(mb)

    def _drain_horizon_s(self) -> float:
        """The latest a sampled run's stage step may end, s (:data:`DRAIN_SPAN_FACTOR`)."""
        first, last = self._arrival_span_s
        return last + max(DRAIN_FLOOR_S, DRAIN_SPAN_FACTOR * (last - first))

    def _past_horizon(self, pipe: _Pipeline, field: str, what: str, d: float, t: float) -> None:
        """Raise: a stage's ``what`` (step / transfer) of ``d`` s from ``t`` would end past the drain horizon."""
        raise DrainHorizonError(f"gear {pipe.gear_id}", field,
                                f"a {what} of {d:.4g} s at {t:.4g} s of simulated time would end past "
                                f"{self._horizon_s:.4g} s (the last arrival + {DRAIN_SPAN_FACTOR:g}x the arrivals' "
                                f"span, at least + {DRAIN_FLOOR_S:g} s): expected stage times a pipeline takes (ms to "
                                "s per step); check the timing's coefficients")

    def _serve(self, pipe: _Pipeline, st: _Stage, mb: _MicroBatch, t: float) -> None:
        d = mb.times_s[mb.stage]
        end = t + d
        st.busy_s += d
        if not self._sampling:
            self._push(end, _DONE, pipe, mb)
            return
        if not end <= self._horizon_s:
            self._past_horizon(pipe, f"stage {mb.stage} step time", "step", d, t)
        period = self._period
        k = int(t // period)
        bw = st.busy_win
        while True:
            w_end = (k + 1) * period
            if end <= w_end:
                bw[k] = bw.get(k, 0.0) + (end - t)
                break
            bw[k] = bw.get(k, 0.0) + (w_end - t)
            t = w_end
            k += 1
        self._push(end, _DONE, pipe, mb)

    def _stage_done(self, pipe: _Pipeline, mb: _MicroBatch, t: float) -> None:
        st = pipe.stages[mb.stage]
        if st.queue:
            self._serve(pipe, st, st.queue.popleft(), t)
        else:
            st.free += 1
        s = mb.stage
        if s + 1 < pipe.num_stages:
            mb.stage = s + 1
            x = mb.xfer_s[s]
            if x > 0.0:
                if self._sampling and not t + x <= self._horizon_s:  # a transfer pushes the clock out as a step does
                    self._past_horizon(pipe, f"stage {s} transfer time", "transfer", x, t)
                self._push(t + x, _ARRIVE, pipe, mb)
            else:
                self._stage_arrive(pipe, mb, t)
        else:
            self._complete(pipe, mb, t)

    # ------------------------------------------------------------------ iterations
    def _complete(self, pipe: _Pipeline, mb: _MicroBatch, t: float) -> None:
        """The last stage finished an iteration: every sequence gained one token."""
        pipe.inflight -= 1
        w = self._window(t) if self._sampling else None
        if w is not None:
            w.tokens += len(mb.seqs)
        keep: list[_Seq] = []
        for s in mb.seqs:
            if s.pf_left:  # part-way through its prompt's chunks: no token yet
                keep.append(s)
                continue
            s.gen += 1
            if s.first_s < 0.0:
                s.first_s = t
                if w is not None and s.online:
                    w.ttft_s.append(t - self._arrival_s[s.idx])
            if s.gen >= s.out:
                s.finish_s = t
                s.gear_id = pipe.gear_id
                pipe.free_blocks += s.blocks
                s.blocks = 0
                self._running -= 1
                self._offline_open -= not s.online
                if w is not None and s.online:
                    w.completed += 1
                    w.e2e_s.append(t - self._arrival_s[s.idx])
                    if s.out > 1:
                        w.tpot_s.append((t - s.first_s) / (s.out - 1))
            else:
                keep.append(s)
        pipe.slots[mb.slot] = keep
        self._launch(pipe, mb.slot, t)
        if self._waiting and self._active.idle:
            self._wake(self._active, t)
        if pipe is not self._active and pipe.inflight == 0 and pipe.drained_s is None and not any(pipe.slots):
            self._mark_drained(pipe, t)

    def _wake(self, pipe: _Pipeline, t: float) -> None:
        if not self._waiting or not pipe.idle:
            return
        idle = pipe.idle
        pipe.idle = []
        for i in idle:
            if self._waiting:
                self._launch(pipe, i, t)
            else:
                pipe.idle.append(i)

    def _preempt(self, pipe: _Pipeline, s: _Seq) -> None:
        pipe.free_blocks += s.blocks
        s.blocks = 0
        s.preempt += 1
        self._running -= 1
        heapq.heappush(self._waiting, (s.key, s))

    def _launch(self, pipe: _Pipeline, slot: int, t: float) -> None:
        """Schedule the slot's next iteration: grow KV for decodes (preempting if full), admit, send."""
        seqs = pipe.slots[slot]
        block = pipe.block
        bounded = pipe.total_blocks > 0
        # 1. decode sequences need blocks for input + generated + 1 tokens
        if seqs and bounded:
            i = 0
            while i < len(seqs):
                s = seqs[i]
                if s.inp + s.gen + 1 > s.blocks * block:
                    if pipe.free_blocks > 0:
                        pipe.free_blocks -= 1
                        s.blocks += 1
                    else:
                        victim = seqs.pop()  # lowest priority in this micro-batch
                        self._preempt(pipe, victim)
                        if victim is s:
                            break
                        continue  # retry s with the freed blocks
                i += 1
        # 2. admissions (prefill in this iteration)
        waiting = self._waiting
        if pipe.admitting and waiting and len(seqs) < pipe.micro_batch_size:
            budget = self.config.prefill_token_budget
            chunked = self.config.chunked_prefill
            prefill_tokens = 0
            admitted = False
            while waiting and len(seqs) < pipe.micro_batch_size:
                s = waiting[0][1]
                if bounded and pipe.blocks_for(kv_tokens_needed(s.inp, s.out)) > pipe.total_blocks:
                    heapq.heappop(waiting)  # could never finish on this gear's KV pool
                    s.rejected, s.reason = True, "kv_capacity"
                    s.gear_id = pipe.gear_id
                    self._offline_open -= not s.online
                    continue
                tokens = s.inp + s.gen
                if chunked:  # a new prompt starts only while this iteration's budget has room left
                    if cast(int, budget) - sum(x.pf_left or 1 for x in seqs) <= 0:
                        break
                elif budget is not None and prefill_tokens and prefill_tokens + tokens > budget:
                    break
                need = pipe.blocks_for(tokens + 1) if bounded else 0
                if need > pipe.free_blocks and not (
                        s.online and self.config.preempt_offline_for_online and self._evict_offline(pipe, seqs, need)):
                    break
                heapq.heappop(waiting)
                if bounded:
                    pipe.free_blocks -= need
                    s.blocks = need
                s.pf_left = tokens
                self._running += 1
                prefill_tokens += tokens
                seqs.append(s)
                admitted = True
            if admitted:
                seqs.sort(key=_seq_key)
        if not seqs:
            pipe.idle.append(slot)
            return
        # 3. compose the micro-batch: prefill tokens, decode sequences and their context; with chunked
        #    prefill the decodes take one token each of the budget and prompts (oldest first) the rest
        prefill_tokens = 0
        n_pf = 0
        n_dec = 0
        ctx = 0
        gid = pipe.gear_id
        room = None
        if self.config.chunked_prefill:
            room = cast(int, self.config.prefill_token_budget) - sum(1 for s in seqs if not s.pf_left)
        for s in seqs:
            if s.pf_left:
                chunk = s.pf_left if room is None else max(0, min(s.pf_left, room))
                if room is not None:
                    room -= chunk
                prefill_tokens += chunk
                n_pf += chunk > 0
                s.pf_left -= chunk
                s.gear_id = gid
            else:
                n_dec += 1
                ctx += s.inp + s.gen
        times, xfer = pipe.iteration_times(prefill_tokens, n_dec, ctx, max(1, n_pf))
        pipe.inflight += 1
        self._stage_arrive(pipe, _MicroBatch(slot, times, xfer, seqs), t)

    def _evict_offline(self, pipe: _Pipeline, seqs: list[_Seq], need: int) -> bool:
        """Preempt offline sequences of this micro-batch (lowest priority first) until ``need`` blocks are free."""
        offline_blocks = sum(s.blocks for s in seqs if not s.online)
        if pipe.free_blocks + offline_blocks < need:
            return False
        while pipe.free_blocks < need:
            for j in range(len(seqs) - 1, -1, -1):
                if not seqs[j].online:
                    self._preempt(pipe, seqs.pop(j))
                    break
        return True

    # ------------------------------------------------------------------ gear shifts
    def _switch(self, pipe: _Pipeline, requested_s: float, t: float) -> None:
        self._pending_switch -= 1
        old = self._active
        old.admitting = False
        self._draining.append(old)
        self._active = pipe
        self._pipes.append(pipe)
        self.shifts.append({"requested_s": requested_s, "switched_s": t, "from_gear_id": old.gear_id,
                            "to_gear_id": pipe.gear_id, "drained_s": None, "_pipe": old})
        if old.inflight == 0 and not any(old.slots):
            self._mark_drained(old, t)
        self._wake(pipe, t)

    def _mark_drained(self, pipe: _Pipeline, t: float) -> None:
        pipe.drained_s = t
        for ev in self.shifts:
            if ev["_pipe"] is pipe and ev["drained_s"] is None:
                ev["drained_s"] = t

    def shift_events(self) -> list[ShiftEvent]:
        """The shifts so far (switch time, drain completion)."""
        return [ShiftEvent(e["requested_s"], e["switched_s"], e["from_gear_id"], e["to_gear_id"], e["drained_s"]) for e in self.shifts]

    # ------------------------------------------------------------------ metric samples
    def _emit_until(self, t: float, strictly_before: bool = False) -> None:
        """Emit samples for every tick ``k * period`` <= t (< t with ``strictly_before``)."""
        period = self._period
        while True:
            tick = self._next_tick * period
            if tick > t or (strictly_before and tick >= t):
                return
            self._emit(self._next_tick - 1, tick)
            self._next_tick += 1

    def _emit(self, k: int, tick: float) -> None:
        period = self._period
        w = self._win.pop(k, None) or _Window()
        pipe = self._active
        used = pipe.used_blocks
        total = pipe.total_blocks
        stages = tuple(
            StageSample(
                stage_index=i,
                busy_fraction=min(1.0, st.busy_win.pop(k, 0.0) / (period * st.replicas)),
                queue_length=len(st.queue),
                kv_blocks_used=used,
                kv_blocks_total=total,
            )
            for i, st in enumerate(pipe.stages)
        )
        for old in self._draining:
            for st in old.stages:
                st.busy_win.pop(k, None)

        def pct(v: list[float], q: float) -> float | None:
            return float(np.percentile(v, q)) * 1000.0 if v else None

        ttft, tpot, e2e = w.ttft_s, w.tpot_s, w.e2e_s
        self.samples.append(MetricSample(
            t_s=tick,
            gear_id=pipe.gear_id,
            source="sim",
            rps=w.arrivals / period,
            completed=w.completed,
            tokens_per_s=w.tokens / period,
            queue_length=len(self._waiting),
            running=self._running,
            kv_used_fraction=(used / total) if total else 0.0,
            ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99),
            tpot_p50_ms=pct(tpot, 50), tpot_p99_ms=pct(tpot, 99),
            e2e_p50_ms=pct(e2e, 50), e2e_p99_ms=pct(e2e, 99),
            stages=stages,
        ))


def _seq_key(s: _Seq) -> _SeqKey:
    return s.key
