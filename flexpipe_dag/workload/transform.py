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
