"""The request ledger: every request the serving front accepted, where it is, and its one output.

Pure bookkeeping (no torch, no processes): thread-safe, plain data in and out. The serving front
(:mod:`~flexpipe_dag.shift.router`) records here which pipeline *lane* holds each request; a lane
reports finished outputs and the ledger delivers each request's output to the caller exactly
once, whichever lane finished it first (a request moved from a failed lane to another may, in a
race, finish on both; the second output is counted and dropped, never delivered).

Internal requests (the executor's warm-up, verification and health probes) live in the same
ledger but are never delivered to the caller: their output is handed to a :class:`Probe` the
executor waits on. Their ids start with :data:`INTERNAL_PREFIX`, which callers may not use.

A server runs for days: an ended entry gives up its request (prompt and all) at once, and is forgotten
once :data:`ENDED_KEPT` newer requests have ended (a late duplicate output of one forgotten is dropped
unseen; its id may be used again). Counts (:meth:`RequestLedger.counts`) are kept as running totals, so
they cover every request ever accepted.

A caller request nobody waits for any more is *cancelled* (:meth:`RequestLedger.cancel`): it leaves
its lane's open work at once, is never moved or delivered, and the output its lane still sends
(its abort) is dropped without counting as a duplicate.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from flexpipe_dag.core.errors import InputError

#: Request-id prefix reserved for the executor's own probe requests.
INTERNAL_PREFIX = "__shift-"

EntryStatus = Literal["held", "pending", "finished", "refused", "failed", "cancelled"]
#: Statuses that end an entry: nothing more is delivered for it.
_ENDED = ("finished", "refused", "failed", "cancelled")
#: Ended entries a ledger remembers (to drop a late duplicate output, and for :meth:`RequestLedger.get`):
#: about a minute of traffic at 1,000 req/s, far longer than a moved request's race between two lanes.
ENDED_KEPT = 50_000


@dataclass(frozen=True)
class EndedRequest:
    """What an ended entry keeps of its request: the id (the prompt and the rest are released)."""

    request_id: str


def request_work_tokens(request: Any) -> int:
    """Prompt + ``max_new_tokens`` of a request (0 for what has neither): the work it brings to a pipeline."""
    prompt = getattr(request, "prompt_token_ids", None) or ()
    return len(prompt) + int(getattr(request, "max_new_tokens", 0) or 0)


class Probe:
    """A handle on one internal request: :meth:`result` blocks until it finished, failed or timed out."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._done = threading.Event()
        self.output: Any = None
        self.error: str | None = None
        self.finished_s: float | None = None

    def _settle(self, output: Any = None, error: str | None = None) -> None:
        if not self._done.is_set():
            self.output, self.error, self.finished_s = output, error, time.monotonic()
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float) -> Any:
        """The request's output (a ``RequestOutput``).

        Raises:
            TimeoutError: not finished within ``timeout_s`` seconds.
            RuntimeError: its lane failed or refused it (the message says why).
        """
        if not self._done.wait(max(0.0, timeout_s)):
            raise TimeoutError(f"probe {self.request_id} did not finish within {timeout_s:.1f} s")
        if self.error is not None:
            raise RuntimeError(f"probe {self.request_id}: {self.error}")
        return self.output


@dataclass
class LedgerEntry:
    """One accepted request: ``lane_id`` is the lane that holds it now (``None`` while held)."""

    request: Any  # flexpipe_dag.runtime.scheduler.Request (kept untyped: no runtime import here)
    lane_id: str | None
    status: EntryStatus
    accepted_s: float
    lanes: list[str] = field(default_factory=list)  # every lane it was submitted to, in order
    finished_by: str | None = None
    probe: Probe | None = None
    work_tokens: int = 0  # prompt + max_new_tokens: the work it brings to a lane (routing by load)

    @property
    def internal(self) -> bool:
        return self.probe is not None

    @property
    def moves(self) -> int:
        """How many times it was re-submitted to another lane."""
        return max(0, len(self.lanes) - 1)


class RequestLedger:
    """Thread-safe map request id -> :class:`LedgerEntry`, with exactly-once delivery.

    Args:
        on_result: called with each caller request's output, exactly once per request id.
        on_refused: called with ``(request_id, reason)`` when a request is finally refused.
        ended_kept: ended entries remembered, newest first (see the module docstring); at least 1.

    Callbacks run in the reporting thread, one at a time (a delivery lock serialises them), after
    the entry was marked, so a callback that raises never causes a second delivery.
    """

    def __init__(self, on_result: Callable[[Any], None] | None = None,
                 on_refused: Callable[[str, str], None] | None = None, ended_kept: int = ENDED_KEPT):
        if ended_kept < 1:
            raise ValueError(f"ended_kept must be at least 1, got {ended_kept}")
        self._on_result, self._on_refused = on_result, on_refused
        self._ended_kept = ended_kept
        self._ended: collections.deque[str] = collections.deque()  # ids of remembered ended entries, oldest first
        self._status_counts: collections.Counter[str] = collections.Counter()  # caller entries per status, ever
        self._lock = threading.RLock()
        self._deliver_lock = threading.Lock()
        self._entries: dict[str, LedgerEntry] = {}
        self._open: dict[str | None, dict[str, LedgerEntry]] = {}  # lane id (None: held) -> open entries
        self._open_tokens: dict[str | None, int] = {}  # lane id -> sum of its open entries' work_tokens
        self._finished_by: dict[str, int] = {}
        self._admitted_to: dict[str | None, int] = {}
        self.duplicates_dropped = 0
        self.moved = 0

    # -- accepting ----------------------------------------------------------------------------------
    def accept(self, request: Any, lane_id: str | None, *, internal: bool = False) -> LedgerEntry:
        """Record a new request, held (``lane_id=None``) or on a lane.

        Raises:
            InputError: the id is open or a remembered ended one (the last :data:`ENDED_KEPT`), or a caller
                id uses the reserved prefix.
        """
        rid = request.request_id
        if not internal and rid.startswith(INTERNAL_PREFIX):
            raise InputError(None, f"request {rid}.request_id", f"ids starting with {INTERNAL_PREFIX!r} are "
                             "reserved for the shift executor's probes")
        with self._lock:
            if rid in self._entries:
                raise InputError(None, f"request {rid}.request_id", "already submitted (ids must be unique)")
            entry = LedgerEntry(request=request, lane_id=lane_id, status="held" if lane_id is None else "pending",
                                accepted_s=time.monotonic(), lanes=[lane_id] if lane_id else [],
                                probe=Probe(rid) if internal else None, work_tokens=request_work_tokens(request))
            self._entries[rid] = entry
            self._open.setdefault(lane_id, {})[rid] = entry
            self._open_tokens[lane_id] = self._open_tokens.get(lane_id, 0) + entry.work_tokens
            if not internal:
                self._status_counts[entry.status] += 1
                self._admitted_to[lane_id] = self._admitted_to.get(lane_id, 0) + 1
            return entry

    def _reindex(self, e: LedgerEntry, old_lane: str | None, old_status: EntryStatus) -> None:
        """After ``e`` moved from ``old_lane`` / ``old_status``: the open index, the counts, and, once it
        ended, its request released and the oldest remembered ended entries forgotten (lock held)."""
        rid = e.request.request_id
        if self._open.get(old_lane, {}).pop(rid, None) is not None:
            self._open_tokens[old_lane] -= e.work_tokens
        if e.status in ("held", "pending"):
            self._open.setdefault(e.lane_id, {})[rid] = e
            self._open_tokens[e.lane_id] = self._open_tokens.get(e.lane_id, 0) + e.work_tokens
        if not e.internal:
            self._status_counts[old_status] -= 1
            self._status_counts[e.status] += 1
        if e.status in _ENDED and old_status not in _ENDED:
            e.request = EndedRequest(rid)
            self._ended.append(rid)
            while len(self._ended) > self._ended_kept:
                self._entries.pop(self._ended.popleft(), None)

    def assign(self, request_id: str, lane_id: str) -> LedgerEntry:
        """Put a held or pending request on ``lane_id`` (a re-submission counts as a move)."""
        with self._lock:
            e = self._entries[request_id]
            if e.status not in ("held", "pending"):
                raise ValueError(f"request {request_id} is {e.status}; only held or pending requests move")
            if e.lanes and e.lanes[-1] != lane_id:
                self.moved += 1
            old, old_status = e.lane_id, e.status
            e.lane_id, e.status = lane_id, "pending"
            e.lanes.append(lane_id)
            if not e.internal:
                self._admitted_to[lane_id] = self._admitted_to.get(lane_id, 0) + 1
            self._reindex(e, old, old_status)
            return e

    def hold(self, request_id: str) -> None:
        """Take a pending request off its lane (it waits for :meth:`assign`)."""
        with self._lock:
            e = self._entries[request_id]
            if e.status == "pending":
                old = e.lane_id
                e.lane_id, e.status = None, "held"
                self._reindex(e, old, "pending")

    # -- outcomes -----------------------------------------------------------------------------------
    def finish(self, output: Any, lane_id: str) -> bool:
        """A lane finished a request. Returns True if this output was delivered (first one wins)."""
        rid = output.request_id
        with self._lock:
            e = self._entries.get(rid)
            if e is None or e.status in _ENDED:
                self.duplicates_dropped += e is not None and e.status != "cancelled"
                return False
            old, old_status = e.lane_id, e.status
            e.status, e.finished_by, e.lane_id = "finished", lane_id, lane_id
            self._reindex(e, old, old_status)
            if e.probe is None:
                self._finished_by[lane_id] = self._finished_by.get(lane_id, 0) + 1
        if e.probe is not None:
            e.probe._settle(output=output)
        elif self._on_result is not None:
            with self._deliver_lock:
                self._on_result(output)
        return True

    def refuse(self, request_id: str, reason: str) -> bool:
        """A request is finally refused (told to the caller once). Returns True if it was open."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.status in _ENDED:
                return False
            old_status, e.status = e.status, "refused"
            self._reindex(e, e.lane_id, old_status)
        if e.probe is not None:
            e.probe._settle(error=f"refused: {reason}")
        elif self._on_refused is not None:
            with self._deliver_lock:
                self._on_refused(request_id, reason)
        return True

    def cancel(self, request_id: str) -> tuple[bool, str | None]:
        """A caller request nobody waits for any more: ended, nothing delivered for it from now on.

        Returns:
            ``(was_open, lane_id)``: whether it was held or pending (False: unknown, an internal probe, or
            already ended), and the lane that holds it (None while held), whose runtime should be told.
        """
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.internal or e.status in _ENDED:
                return False, None
            lane_id, old_status = e.lane_id, e.status
            e.status = "cancelled"
            self._reindex(e, lane_id, old_status)
            return True, lane_id

    def fail_internal(self, lane_id: str, reason: str) -> int:
        """Fail every open internal request on ``lane_id`` (its lane died); returns how many."""
        with self._lock:
            hit = [e for e in self._open.get(lane_id, {}).values() if e.internal]
            for e in hit:
                old_status, e.status = e.status, "failed"
                self._reindex(e, lane_id, old_status)
        for e in hit:
            if e.probe is not None:  # always: an entry is internal exactly when it has a probe
                e.probe._settle(error=reason)
        return len(hit)

    # -- queries ------------------------------------------------------------------------------------
    def get(self, request_id: str) -> LedgerEntry:
        """The entry of an open or remembered ended request (an ended one's ``request`` is an :class:`EndedRequest`).

        Raises:
            KeyError: never accepted, or ended and since forgotten.
        """
        with self._lock:
            return self._entries[request_id]

    def find(self, request_id: str) -> LedgerEntry | None:
        """As :meth:`get`, but None for an id never accepted or forgotten."""
        with self._lock:
            return self._entries.get(request_id)

    def probe(self, request_id: str) -> Probe:
        with self._lock:
            p = self._entries[request_id].probe
        if p is None:
            raise KeyError(f"{request_id} is not an internal request")
        return p

    def open_on(self, lane_id: str | None, *, internal: bool | None = False) -> list[LedgerEntry]:
        """Pending entries on ``lane_id`` (``None``: the held ones) in acceptance order (``internal=None``:
        both kinds)."""
        with self._lock:
            return [e for e in self._open.get(lane_id, {}).values() if internal is None or e.internal == internal]

    def has_open(self, lane_id: str) -> bool:
        """Whether any request (caller or internal) is pending on ``lane_id``."""
        with self._lock:
            return bool(self._open.get(lane_id))

    def open_tokens(self, lane_id: str) -> int:
        """Outstanding work on ``lane_id``, in tokens: prompt + ``max_new_tokens`` summed over every request
        (caller or internal) still pending there. The router sends a new request to the instance with the least."""
        with self._lock:
            return self._open_tokens.get(lane_id, 0)

    def num_finished_by(self, lane_id: str) -> int:
        """Caller requests whose delivered output came from ``lane_id``."""
        with self._lock:
            return self._finished_by.get(lane_id, 0)

    def num_admitted_to(self, lane_id: str) -> int:
        """Caller requests ever submitted to ``lane_id`` (first submissions and moves)."""
        with self._lock:
            return self._admitted_to.get(lane_id, 0)

    def num_open(self, lane_id: str | None = None) -> int:
        """Caller requests not yet finished or refused (on ``lane_id``, or anywhere incl. held)."""
        with self._lock:
            pools = [self._open.get(lane_id, {})] if lane_id is not None else list(self._open.values())
            return sum(1 for pool in pools for e in pool.values() if not e.internal)

    def counts(self) -> dict[str, int]:
        """Caller requests per status (``cancelled`` included), plus ``moved`` and ``duplicates_dropped``."""
        with self._lock:
            out = {s: self._status_counts[s] for s in ("held", "pending", *_ENDED)}
            out["moved"], out["duplicates_dropped"] = self.moved, self.duplicates_dropped
            return out
