"""Requests and workloads: the plain data every loader produces and the simulator (and runtime) consume.

A :class:`Workload` is an arrival-ordered tuple of :class:`Request` records. It converts to plain
dicts / JSONL (:meth:`Workload.to_dicts`, :func:`write_requests_jsonl`) in exactly the generic
form :func:`flexpipe_dag.workload.loaders.load_request_file` reads, so one workload file can drive
both the simulator and the live runtime (the fidelity hook).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

RequestClass = Literal["online", "offline"]
REQUEST_CLASSES: tuple[str, ...] = ("online", "offline")

#: Columns of the generic request form (CSV header / JSONL keys), in order.
#: Latest arrival a trace may hold, seconds after its start (31 days; after any --speedup): the
#: simulator steps through every metric sample up to the last arrival, so a trace that runs for years
#: would run (and grow) for hours. Longer studies split the trace.
MAX_ARRIVAL_S = 31 * 86400.0
GENERIC_COLUMNS: tuple[str, ...] = ("request_id", "arrival_s", "input_tokens", "output_tokens", "class", "priority")


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request.

    Attributes:
        request_id: unique within its workload.
        arrival_s: arrival time, seconds since the start of the workload (>= 0).
        input_tokens: prompt length in tokens (>= 1).
        output_tokens: tokens to generate (>= 1; the first comes out of prefill).
        klass: ``"online"`` (latency-sensitive, served first) or ``"offline"`` (batch backlog).
        priority: within a class, a larger value is served first (same sense as Dagster's
            ``dagster/priority`` tag); default 0.
    """

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    klass: RequestClass = "online"
    priority: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The generic form: ``{request_id, arrival_s, input_tokens, output_tokens, class, priority}``."""
        return {
            "request_id": self.request_id,
            "arrival_s": float(self.arrival_s),
            "input_tokens": int(self.input_tokens),
            "output_tokens": int(self.output_tokens),
            "class": self.klass,
            "priority": int(self.priority),
        }


@dataclass(frozen=True)
class Workload:
    """An arrival-ordered sequence of requests plus where it came from.

    Build one with the loaders in :mod:`flexpipe_dag.workload.loaders` or :meth:`from_frame`;
    ``requests`` must already be sorted by ``arrival_s`` (the loaders sort, with a warning).
    """

    name: str
    requests: tuple[Request, ...]
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        """Span from the first to the last arrival, seconds (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_rate_rps(self) -> float:
        """Arrivals per second over :attr:`duration_s` (0 when the span is 0)."""
        d = self.duration_s
        return (len(self.requests) - 1) / d if d > 0 else 0.0

    def peak_rate_rps(self, window_s: float) -> float:
        """Most arrivals in any ``window_s`` seconds (a window starting at an arrival), per second; the
        mean rate when the workload spans less than one window.

        Raises:
            ValueError: ``window_s`` is not a positive finite number."""
        import numpy as np

        if not (window_s > 0 and np.isfinite(window_s)):
            raise ValueError(f"window_s: expected a positive number of seconds, got {window_s}")
        if self.duration_s < window_s:
            return self.mean_rate_rps
        arrivals = np.sort(np.fromiter((r.arrival_s for r in self.requests), dtype=float, count=len(self.requests)))
        in_window = np.searchsorted(arrivals, arrivals + window_s, side="left") - np.arange(len(arrivals))
        return float(in_window.max()) / window_s

    def check_horizon(self) -> None:
        """Refuse an arrival that is not finite or is later than :data:`MAX_ARRIVAL_S`.

        Raises:
            InputError: naming the workload's source and the first such request (``request <id>.arrival_s``).
        """
        import math

        from flexpipe_dag.core.errors import InputError, shown

        for r in self.requests:
            if not (math.isfinite(r.arrival_s) and 0 <= r.arrival_s <= MAX_ARRIVAL_S):
                raise InputError(self.source or self.name, f"request {shown(r.request_id, 80)}.arrival_s",
                                 f"got {r.arrival_s:g} s; expected 0..{MAX_ARRIVAL_S:.0f} s (31 days, after any "
                                 f"speedup); split a longer trace")

    def count_by_class(self) -> dict[str, int]:
        out = {k: 0 for k in REQUEST_CLASSES}
        for r in self.requests:
            out[r.klass] += 1
        return out

    def to_dicts(self) -> list[dict[str, Any]]:
        """Plain dict requests in the generic form (what the live runtime's driver replays)."""
        return [r.to_dict() for r in self.requests]

    def to_frame(self) -> pd.DataFrame:
        """A DataFrame with :data:`GENERIC_COLUMNS`, one row per request."""
        return pd.DataFrame(self.to_dicts(), columns=list(GENERIC_COLUMNS))

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, name: str, source: str = "", meta: dict[str, Any] | None = None) -> Workload:
        """Build from a validated frame with :data:`GENERIC_COLUMNS` (already sorted by arrival)."""
        reqs = tuple(
            Request(str(rid), float(t), int(i), int(o), str(k), int(p))  # type: ignore[arg-type]
            for rid, t, i, o, k, p in zip(
                frame["request_id"], frame["arrival_s"], frame["input_tokens"], frame["output_tokens"],
                frame["class"], frame["priority"],
            )
        )
        return cls(name=name, requests=reqs, source=source, meta=dict(meta or {}))

    @classmethod
    def from_requests(cls, requests: Iterable[Request], name: str, source: str = "", meta: dict[str, Any] | None = None) -> Workload:
        """Build from any iterable of requests; sorts them by ``(arrival_s, request_id)``."""
        reqs = tuple(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))
        return cls(name=name, requests=reqs, source=source, meta=dict(meta or {}))


def to_plain_dicts(workload: Workload) -> list[dict[str, Any]]:
    """Fidelity hook: the workload as plain dicts (generic form), for the live runtime's load driver."""
    return workload.to_dicts()


def write_requests_jsonl(workload: Workload, path: str | Path) -> Path:
    """Write the workload as JSONL in the generic form; :func:`load_request_file` reads it back unchanged."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as fh:
        for d in workload.to_dicts():
            fh.write(json.dumps(d) + "\n")
    return path
