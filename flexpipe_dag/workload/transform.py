"""Workload transforms: time compression (speedup), windows, and mixing online traffic with an offline backlog."""

from __future__ import annotations

import dataclasses

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.workload.request import Request, Workload

#: Range of a speedup factor: from a thousand times slower to a million times faster than written.
MIN_SPEEDUP = 1e-3
MAX_SPEEDUP = 1e6


def speedup(workload: Workload, factor: float) -> Workload:
    """Compress time by ``factor``: arrival ``a`` becomes ``a / factor`` (the rate grows ``factor`` x).

    Raises:
        InputError: ``factor`` outside :data:`MIN_SPEEDUP`..:data:`MAX_SPEEDUP` (or not a number), or an
            arrival lands beyond :data:`~flexpipe_dag.workload.request.MAX_ARRIVAL_S` (the request named).
    """
    if not MIN_SPEEDUP <= factor <= MAX_SPEEDUP:
        raise InputError(workload.source or workload.name, "speedup",
                         f"got {factor:g}; expected a factor {MIN_SPEEDUP:g}..{MAX_SPEEDUP:g}")
    reqs = tuple(Request(r.request_id, r.arrival_s / factor, r.input_tokens, r.output_tokens, r.klass, r.priority)
                 for r in workload.requests)
    out = Workload(name=workload.name if factor == 1 else f"{workload.name}x{factor:g}", requests=reqs,
                   source=workload.source, meta={**workload.meta, "speedup": factor})
    out.check_horizon()
    return out


def time_window(workload: Workload, start_s: float, end_s: float, *, rebase: bool = True) -> Workload:
    """Requests arriving in ``[start_s, end_s)``; with ``rebase`` the window starts at 0 s."""
    if end_s <= start_s:
        raise InputError(workload.source or workload.name, "end_s", f"got [{start_s}, {end_s}); expected end_s > start_s")
    off = start_s if rebase else 0.0
    reqs = tuple(Request(r.request_id, r.arrival_s - off, r.input_tokens, r.output_tokens, r.klass, r.priority)
                 for r in workload.requests if start_s <= r.arrival_s < end_s)
    return Workload(name=f"{workload.name}[{start_s:g}:{end_s:g}]", requests=reqs, source=workload.source, meta=dict(workload.meta))


def head(workload: Workload, n: int) -> Workload:
    """The first ``n`` requests by arrival."""
    if n < 1:
        raise InputError(workload.source or workload.name, "n", f"got {n}; expected >= 1")
    return Workload(name=f"{workload.name}[:{n}]", requests=workload.requests[:n], source=workload.source, meta=dict(workload.meta))


def slice_requests(workload: Workload, start: int, stop: int) -> Workload:
    """Requests ``start..stop-1`` by arrival, their arrival times shifted so the first arrives at 0 s.

    Raises:
        InputError: ``start`` < 0 or ``stop`` <= ``start`` (an empty slice).
    """
    if start < 0 or stop <= start:
        raise InputError(workload.source or workload.name, "start/stop", f"got {start}..{stop}; expected 0 <= start < stop")
    reqs = workload.requests[start:stop]
    t0 = reqs[0].arrival_s if reqs else 0.0
    shifted = tuple(dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in reqs)
    return Workload(name=f"{workload.name}[{start}:{start + len(shifted)}]", requests=shifted, source=workload.source,
                    meta=dict(workload.meta))


def sample_chunks(workload: Workload, n: int, *, chunk_requests: int = 100, phase: float = 0.0) -> Workload:
    """``n`` requests drawn from across the whole of ``workload``: runs of ``chunk_requests`` consecutive
    requests at evenly spaced positions, stitched end to end.

    A trace's first minutes are not its typical minutes (the first 1,000 requests of Azure conv have
    prompts 15-25 % shorter than the next thousands), and an envelope measured on them is that
    stretch's, not the trace's. Runs keep the trace's own burstiness and lengths inside each run;
    each run starts one mean inter-arrival gap of the whole trace after the previous one ends.

    Run ``j`` of ``k = ceil(n / chunk_requests)`` (``n / k`` requests each) starts at request
    ``floor((j + phase) x len / k)``, or right after the previous run if that is later.
    Samples with phases 0 and 0.5 share no request as long as ``len >= 2 n`` (the planner measures on
    phase 0; :func:`~flexpipe_dag.planner.envelope.holdout_reference` checks on phase 0.5). A
    workload of at most ``n`` requests is returned whole, rebased to start at 0 s.

    Raises:
        InputError: ``n`` or ``chunk_requests`` < 1, or ``phase`` outside [0, 1).
    """
    where = workload.source or workload.name
    if n < 1:
        raise InputError(where, "n", f"got {n}; expected >= 1")
    if chunk_requests < 1:
        raise InputError(where, "chunk_requests", f"got {chunk_requests}; expected >= 1")
    if not 0.0 <= phase < 1.0:
        raise InputError(where, "phase", f"got {phase}; expected 0 <= phase < 1")
    total = len(workload)
    if total <= n:
        return slice_requests(workload, 0, total) if total else workload
    reqs = workload.requests
    k = -(-n // chunk_requests)
    stride = total / k
    gap_s = workload.duration_s / (total - 1)
    out: list[Request] = []
    t_s = 0.0
    end = 0  # runs never overlap, and the last ends inside the trace
    for j in range(k):
        length = n // k + (j < n % k)
        start = min(max(int((j + phase) * stride), end), total - (n - len(out)))
        end = start + length
        run = reqs[start:end]
        a0 = run[0].arrival_s
        span_s = run[-1].arrival_s - a0
        # each run at the trace's mean rate: its bursts kept, the drift of the rate across the trace taken out
        scale = gap_s * (len(run) - 1) / span_s if span_s > 0 else 1.0
        out.extend(dataclasses.replace(r, arrival_s=t_s + (r.arrival_s - a0) * scale) for r in run)
        t_s = out[-1].arrival_s + gap_s
    return Workload(name=f"{workload.name}[{n} in runs of {chunk_requests}, phase {phase:g}]", requests=tuple(out),
                    source=workload.source, meta={**workload.meta, "sample": {"n": n, "chunk_requests": chunk_requests,
                                                                             "phase": phase}})


def repeat_to(workload: Workload, n: int) -> Workload:
    """``n`` requests: ``workload``'s requests pass after pass, each pass starting one mean inter-arrival gap
    after the previous pass's last arrival; request ids of pass ``k >= 1`` end in ``~k`` (unique).

    For a replay that must last longer than the trace does at a high rate (an envelope probe,
    :func:`~flexpipe_dag.planner.envelope.probe_reference`). A workload of at least ``n`` requests gives
    its first ``n``.

    Raises:
        InputError: ``n`` < 1, or an empty workload.
    """
    where = workload.source or workload.name
    if n < 1:
        raise InputError(where, "n", f"got {n}; expected >= 1")
    reqs = workload.requests
    if not reqs:
        raise InputError(where, None, "an empty workload cannot be repeated")
    if len(reqs) >= n:
        return head(workload, n)
    t0 = reqs[0].arrival_s
    span_s = reqs[-1].arrival_s - t0
    gap_s = span_s / (len(reqs) - 1) if len(reqs) > 1 and span_s > 0 else 1.0
    out: list[Request] = []
    offset_s = 0.0
    for k in range(-(-n // len(reqs))):
        suffix = f"~{k}" if k else ""
        out.extend(dataclasses.replace(r, request_id=f"{r.request_id}{suffix}", arrival_s=offset_s + r.arrival_s - t0)
                   for r in reqs[:n - len(out)])
        offset_s += span_s + gap_s
    return Workload(name=f"{workload.name}[repeated to {n}]", requests=tuple(out), source=workload.source,
                    meta={**workload.meta, "repeated_to": n})


def as_class(workload: Workload, klass: str, *, priority: int | None = None, arrival_s: float | None = None) -> Workload:
    """Relabel every request as ``klass`` (optionally set priority, or queue all at ``arrival_s``)."""
    if klass not in ("online", "offline"):
        raise InputError(workload.source or workload.name, "class", f"got {klass!r}; expected 'online' or 'offline'")
    reqs = tuple(Request(r.request_id, r.arrival_s if arrival_s is None else float(arrival_s), r.input_tokens, r.output_tokens,
                         klass, r.priority if priority is None else priority)  # type: ignore[arg-type]
                 for r in workload.requests)
    return Workload.from_requests(reqs, name=workload.name, source=workload.source, meta=dict(workload.meta))


def mix(*workloads: Workload, name: str | None = None) -> Workload:
    """Merge workloads (e.g. an online trace and an offline backlog) into one, ordered by arrival.

    Ids must stay unique across the inputs (loaders prefix them with the file stem).

    Raises:
        InputError: a request id appears in more than one input.
    """
    seen: set[str] = set()
    for w in workloads:
        for r in w.requests:
            if r.request_id in seen:
                raise InputError(w.source or w.name, "request_id",
                                 f"id {r.request_id!r} appears in more than one workload; expected unique ids")
            seen.add(r.request_id)
    merged = [r for w in workloads for r in w.requests]
    return Workload.from_requests(merged, name=name or "+".join(w.name for w in workloads),
                                  source=";".join(w.source for w in workloads if w.source),
                                  meta={"parts": [w.name for w in workloads]})
