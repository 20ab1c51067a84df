"""The serving front: one entry point for online and offline requests over the live pipeline(s).

:class:`ServingRouter` owns the lanes (:mod:`~flexpipe_dag.shift.lane`: one live pipeline runtime
each) and a :class:`~flexpipe_dag.shift.ledger.RequestLedger`. Every request goes through
:meth:`ServingRouter.submit`; the router puts it on the *active* lane (the entry point), or holds
it while the entry point is closed (a cold shift, a KV-pool growth, no live pipeline). Each
request's output reaches ``on_result`` exactly once.

Switching the entry point (:meth:`ServingRouter.switch_to`) is atomic: submission and switch
take the same lock, so every request lands on exactly one lane, either the old gear (where it
finishes) or the new one. When a lane fails (crashed / raising / hung stage, reported by its
pump), its delivered outputs are kept, and every request it held that did not finish is
re-submitted: to the *fallback* lane if the failed lane was the entry point and a fallback is
set (the executor's double buffer: traffic returns to the old gear), to the entry point if the
failed lane was not it (e.g. an old gear that died while draining), or held until a pipeline is
opened (:meth:`ServingRouter.open`) when nothing is left.

Several instances (:meth:`ServingRouter.route_to`, :meth:`ServingRouter.withdraw`; managed by
:class:`~flexpipe_dag.shift.instances.InstanceFleet`): next to the entry point, further live lanes
take requests too. Each request goes to the instance with the least outstanding work (prompt +
``max_new_tokens`` tokens of the requests open there, :meth:`RequestLedger.open_tokens`; ties: fewer
open requests, then the entry point first) among those whose context and KV pool can ever hold it
(:meth:`Lane.can_hold`); a request no instance can hold is refused by the router with the numbers. With
one instance the router adds no check of its own (its runtime refuses what it cannot hold, as before).
:meth:`ServingRouter.hold` closes the entry point only: further instances keep taking requests.

Priorities: requests carry their own ``priority`` (0 online, larger offline); each runtime's
scheduler admits online first. The router does not reorder them.

Cancelling (:meth:`ServingRouter.cancel`): a request nobody waits for any more leaves the ledger and
its lane's scheduler at once, its KV blocks freed.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.shift.instance_samples import InstanceRound
from flexpipe_dag.shift.lane import Lane, LaneState
from flexpipe_dag.shift.ledger import INTERNAL_PREFIX, LedgerEntry, Probe, RequestLedger

if TYPE_CHECKING:  # pragma: no cover
    from flexpipe_dag.core.metrics import MetricSample
    from flexpipe_dag.runtime.pipeline import PipelineRuntime
    from flexpipe_dag.runtime.scheduler import Request, RequestOutput

#: How often the monitor thread collects refusals from lanes whose pump is busy, seconds.
REFUSAL_POLL_S = 0.25
#: Retired or failed lanes a router remembers (:meth:`ServingRouter.lane` still finds them), the latest added
#: kept: a server shifts for days, and each dead lane holds its runtime (up to 10,000 metric samples).
DEAD_LANES_KEPT = 32


class ServingRouter:
    """Entry point over live pipelines, with exactly-once delivery. Use as a context manager.

    It implements its lanes' :class:`~flexpipe_dag.shift.lane.LaneOwner` (``lane_failed``, ``lane_gone``,
    ``lane_refused``, ``lane_metrics`` are called from lane threads).

    Args:
        on_result: ``RequestOutput -> None``, called once per caller request (in a pump thread).
        on_refused: ``(request_id, reason) -> None`` for requests no pipeline will serve (e.g.
            prompt + ``max_new_tokens`` - 1 KV tokens more than one lane of the KV pool holds).
        on_metrics: ``MetricSample -> None``, the serving stream the controller and the offline admission
            read: every sample a lane takes while it has requests open (``gear_id`` tells which gear), and of
            the samples it takes while idle, the entry point's (an idle server's zero load is the news) and
            those that record work (a lane's last requests' window). A standby or warming lane's empty
            windows, and a draining lane's of another gear, describe no traffic and are left out: they would
            halve the rate the readers see, or read as the serving gear's. While two or more lanes of the entry
            point's gear hold traffic (several instances; a withdrawn instance or an old pipeline draining),
            their windows are merged, one sample per round of their reports
            (:mod:`~flexpipe_dag.shift.instance_samples`): the fleet's rates and counts, ``instances`` = how
            many of them take new requests; a standby lane of that gear is left out meanwhile. A warming lane
            of the entry point's gear (a new instance, a pool growth's new pipeline) is always left out: its
            windows hold the warm-up's probes only, and would read as the serving gear's.
        on_lane_sample: ``(lane_id, MetricSample) -> None``, every sample of every lane, empty windows
            included: what each pipeline holds now (per-pipeline gauges).
        on_tokens: ``(request_id, index, token_id) -> None`` for every token a caller request's
            pipeline sampled, as it comes (runtimes started with ``stream_tokens``). A request moved to
            another lane (a failure, a cold shift) starts again there, so an ``index`` can come twice:
            a streaming caller keeps the first and sends each index once.

    Attributes:
        ledger: the :class:`RequestLedger`.
        failures: ``(lane_id, reason)`` of every lane that failed, oldest first.
        fallback: the lane traffic returns to if the active lane fails (set by the executor).

    Callbacks never run under the router's lock (a callback may call :meth:`submit`).
    """

    def __init__(self, on_result: Callable[[RequestOutput], None] | None = None,
                 on_refused: Callable[[str, str], None] | None = None,
                 on_metrics: Callable[[MetricSample], None] | None = None,
                 on_tokens: Callable[[str, int, int], None] | None = None,
                 on_lane_sample: Callable[[str, MetricSample], None] | None = None):
        self.ledger = RequestLedger(on_result, on_refused)
        self._on_metrics = on_metrics
        self._on_lane_sample = on_lane_sample
        self._on_tokens = on_tokens
        self._lock = threading.RLock()
        self._rounds = InstanceRound()  # several lanes of the entry point's gear: one serving-stream sample a round
        self._lanes: dict[str, Lane] = {}
        self._active: Lane | None = None
        self._instances: list[Lane] = []  # further lanes requests are routed to, beside the entry point
        self._refusals: dict[str, str] = {}  # request id -> reason, refused by the router once its lock is free
        self.fallback: Lane | None = None
        self._holding = False
        self._parked: list[str] = []
        self.failures: list[tuple[str, str]] = []
        self._seq = itertools.count(1)
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._poll_refusals, name="flexpipe-router-monitor", daemon=True)
        self._monitor.start()

    # -- lanes --------------------------------------------------------------------------------------
    def add_lane(self, runtime: PipelineRuntime, state: LaneState = "warming") -> Lane:
        """Wrap a *started* runtime in a lane (not the entry point) and start its pump."""
        lane = Lane(f"{runtime.gear.gear_id}#{next(self._seq)}", runtime, self)
        lane.state = state
        with self._lock:
            self._lanes[lane.lane_id] = lane
        lane.start_pump()
        return lane

    def open(self, runtime: PipelineRuntime) -> Lane:
        """Start ``runtime`` if needed and make it the entry point; held requests go to it.

        Raises: whatever ``runtime.start()`` raises (InputError, InfeasibleError, StageFailedError).
        """
        if not runtime.stage_info:
            runtime.start()
        lane = self.add_lane(runtime, state="active")
        with self._lock:
            old = self._active
            self._active = lane
            if old is not None and old.alive and old is not lane:
                old.state = "draining"
            self._holding = False
            self._flush_held()
            self._flush_parked()
        self._flush_refusals()
        return lane

    @property
    def active(self) -> Lane | None:
        """The entry-point lane, the one a gear shift moves (``None`` before :meth:`open`). When it died
        while further instances serve, the first live one of them."""
        with self._lock:
            a = self._active
            if a is not None and a.alive:
                return a
            return next((ln for ln in self._instances if ln.alive), a)

    @property
    def lanes(self) -> list[Lane]:
        with self._lock:
            return list(self._lanes.values())

    @property
    def instances(self) -> list[Lane]:
        """The live lanes new requests are routed to: the entry point first, then the further instances
        (:meth:`route_to`), in the order they were added."""
        with self._lock:
            entry = self.active
            lanes = ([entry] if entry is not None else []) + [ln for ln in self._instances if ln is not entry]
            return [ln for ln in lanes if ln.alive]

    def lane(self, lane_id: str) -> Lane:
        """The lane named ``lane_id``.

        Raises:
            InputError: no lane of this router has that id (the message lists them).
        """
        with self._lock:
            found = self._lanes.get(lane_id)
            if found is None:
                raise InputError(None, "lane_id", f"no lane {lane_id!r}; this router has {sorted(self._lanes)}")
            return found

    def route_to(self, lane: Lane) -> None:
        """Atomically add a live ``lane`` to the instances new requests are routed to, beside the entry
        point (it becomes the entry point when there is none). Held requests are sent out again.

        Raises:
            InputError: the lane is retired or failed.
        """
        with self._lock:
            if not lane.alive:
                raise InputError(None, "lane", f"lane {lane.lane_id} is {lane.state}; cannot route to it")
            lane.state = "active"
            entry = self.active
            if entry is None or not entry.alive:
                self._active = lane
            elif lane is not entry and lane not in self._instances:
                self._instances.append(lane)
            self._flush_held()
        self._flush_refusals()

    def withdraw(self, lane: Lane) -> None:
        """Atomically stop routing new requests to ``lane``; it drains (requests already there finish
        there). When it was the entry point, the least loaded other instance becomes the entry point.

        Raises:
            InputError: ``lane`` is the last live instance (add another one first), or not routed to.
        """
        with self._lock:
            routed = self.instances
            if lane not in routed:
                raise InputError(None, "lane", f"lane {lane.lane_id} ({lane.state}) is not one of the instances "
                                 f"requests are routed to: {[ln.lane_id for ln in routed]}")
            others = [ln for ln in routed if ln is not lane]
            if not others:
                raise InputError(None, "lane", f"lane {lane.lane_id} is the last live instance; add another "
                                 "before withdrawing it (requests would wait with nowhere to go)")
            if lane in self._instances:
                self._instances.remove(lane)
            if lane is self.active:
                successor = min(others, key=self._load)
                self._instances.remove(successor)
                self._active = successor
            lane.state = "draining"

    def switch_to(self, lane: Lane) -> Lane | None:
        """Atomically make ``lane`` the entry point; the previous one starts draining (its requests
        finish there). Held requests go to ``lane`` unless the router is holding. Returns the old lane."""
        with self._lock:
            if not lane.alive:
                raise InputError(None, "lane", f"lane {lane.lane_id} is {lane.state}; cannot switch to it")
            old, self._active = self.active, lane
            lane.state = "active"
            if lane in self._instances:
                self._instances.remove(lane)
            if old is not None and old is not lane and old.alive:
                old.state = "draining"
                if old in self._instances:
                    self._instances.remove(old)
            self._flush_held()
        self._flush_refusals()
        return old

    # -- admission ----------------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> list[str]:
        """Accept requests (online and offline alike) and send them to the entry point, or hold them.

        Raises:
            InputError: a request id was submitted before, or uses the executor's reserved prefix.
        """
        reqs = list(requests)
        with self._lock:
            batches: dict[str, tuple[Lane, list[Request]]] = {}
            try:
                for r in reqs:
                    lane, refusal = self._route(r)
                    self.ledger.accept(r, lane.lane_id if lane else None)
                    if refusal is not None:
                        self._refusals[r.request_id] = refusal
                    elif lane is not None:
                        batches.setdefault(lane.lane_id, (lane, []))[1].append(r)
            finally:  # what was accepted before a bad id is served
                for lane, batch in batches.values():
                    lane.runtime.submit(batch)
        self._flush_refusals()
        return [r.request_id for r in reqs]

    def cancel(self, request_id: str) -> bool:
        """Stop serving a caller request nobody waits for any more (its client went away, or a stop sequence
        ended its response): nothing is delivered for it from now on, it is never moved to another lane, and
        the lane that holds it is told to end it and free its KV blocks
        (:meth:`~flexpipe_dag.runtime.pipeline.PipelineRuntime.cancel`). Any thread; non-blocking.

        Returns:
            True if it was open (held or on a lane); False for an unknown id, a probe, or one that had
            already finished, been refused or been cancelled.
        """
        with self._lock:
            was_open, lane_id = self.ledger.cancel(request_id)
            self._refusals.pop(request_id, None)
            if request_id in self._parked:
                self._parked.remove(request_id)
            lane = self._lanes.get(lane_id) if lane_id is not None else None
        if lane is not None and lane.alive:
            lane.runtime.cancel([request_id])
        return was_open

    def probe_id(self, kind: str) -> str:
        """A fresh id for an internal request (unique within this router)."""
        return f"{INTERNAL_PREFIX}{kind}-{next(self._seq)}"

    def submit_probe(self, lane: Lane, request: Request) -> Probe:
        """Send an internal (executor) request straight to ``lane``; its output goes to the probe."""
        entry = self.ledger.accept(request, lane.lane_id, internal=True)
        if lane.alive:
            lane.runtime.submit([request])
        else:
            self.ledger.fail_internal(lane.lane_id, f"lane {lane.lane_id} is {lane.state}")
        assert entry.probe is not None  # accept(internal=True) always gives the entry a probe
        return entry.probe

    def _routable(self, exclude: Lane | None = None) -> list[Lane]:
        """Live lanes a request may go to now: the entry point (unless held) and the further instances."""
        lanes = self.instances
        if self._holding and lanes and lanes[0] is self.active:
            lanes = lanes[1:]
        return [ln for ln in lanes if ln is not exclude]

    def _load(self, lane: Lane) -> tuple[int, int]:
        """Outstanding work on ``lane``: tokens (prompt + ``max_new_tokens``) of its open requests, then their count."""
        return self.ledger.open_tokens(lane.lane_id), self.ledger.num_open(lane.lane_id)

    def _route(self, request: Request, exclude: Lane | None = None) -> tuple[Lane | None, str | None]:
        """Where ``request`` goes: ``(lane, None)``; ``(None, None)`` to hold it (nothing to route to);
        ``(None, reason)`` when no instance can ever hold it (only with several instances)."""
        lanes = self._routable(exclude)
        if len(lanes) <= 1:  # one pipeline: its own runtime refuses what it cannot hold (its reason)
            return (lanes[0] if lanes else None), None
        fits = [ln for ln in lanes if ln.can_hold(request)] or [ln for ln in lanes if ln.refusal_policy != "final"]
        if fits:  # (a lane whose refusals are parked holds it until its KV pool grows)
            return min(fits, key=self._load), None
        prompt = len(request.prompt_token_ids)
        limits = ", ".join(f"{ln.lane_id} {ln.runtime.longest_request_tokens}" for ln in lanes)
        return None, (f"request {request.request_id!r}: prompt {prompt} + max_new_tokens {request.max_new_tokens} = "
                      f"{prompt + request.max_new_tokens} tokens; no instance can hold it (the longest request each "
                      f"serves, its context and one lane of its KV pool: {limits} tokens); shorten it or add an "
                      f"instance with a larger KV pool or context")

    def _dispatch(self, entries: list[LedgerEntry], exclude: Lane | None = None) -> int:
        """Send each open entry to its instance (:meth:`_route`), hold it, or queue its refusal; returns how
        many were sent. Caller holds the lock."""
        batches: dict[str, tuple[Lane, list[Request]]] = {}
        for e in entries:
            rid = e.request.request_id
            if rid in self._refusals:
                continue
            lane, refusal = self._route(e.request, exclude)
            if lane is None:
                self.ledger.hold(rid)
                if refusal is not None:
                    self._refusals[rid] = refusal
                continue
            self.ledger.assign(rid, lane.lane_id)
            batches.setdefault(lane.lane_id, (lane, []))[1].append(e.request)
        for lane, batch in batches.values():
            lane.runtime.submit(batch)
        return sum(len(batch) for _, batch in batches.values())

    def _flush_refusals(self) -> None:
        """Refuse (and tell the caller) what :meth:`_route` found no instance for; outside the lock."""
        with self._lock:
            refusals, self._refusals = self._refusals, {}
        for rid, reason in refusals.items():
            self.ledger.refuse(rid, reason)

    def hold(self) -> None:
        """Close the entry point: new requests wait in the router until :meth:`release_held` (or go to
        the further instances, when there are any)."""
        with self._lock:
            self._holding = True

    def release_held(self) -> int:
        """Open the entry point again; send every held request to it. Returns how many went."""
        with self._lock:
            self._holding = False
            sent = self._flush_held()
        self._flush_refusals()
        return sent

    def _flush_held(self) -> int:
        if not self._routable():
            return 0
        held = self.ledger.open_on(None)
        return self._dispatch(held) if held else 0

    def _send(self, entries: list[LedgerEntry], lane: Lane) -> int:
        for e in entries:
            self.ledger.assign(e.request.request_id, lane.lane_id)
        lane.runtime.submit([e.request for e in entries])
        return len(entries)

    def move_open(self, src: Lane, dst: Lane | None = None) -> int:
        """Re-submit every caller request open on ``src`` to ``dst`` (default: routed to the other
        instances, or held if there is none). Only for a lane that will not finish them (failed or killed)."""
        with self._lock:
            moved = self._move_open(src, dst)
        self._flush_refusals()
        return moved

    def _move_open(self, src: Lane, dst: Lane | None = None) -> int:
        entries = self.ledger.open_on(src.lane_id)
        if not entries:
            return 0
        if dst is not None and dst.alive and dst is not src:
            return self._send(entries, dst)
        self._dispatch(entries, exclude=src)
        return len(entries)

    def resubmit_parked(self) -> int:
        """Send requests parked after a refusal (degraded KV pool, failed health check) to the instances."""
        with self._lock:
            sent = self._flush_parked()
        self._flush_refusals()
        return sent

    def _flush_parked(self) -> int:
        if not self._routable() or not self._parked:
            return 0
        entries = [self.ledger.find(rid) for rid in self._parked]
        self._parked = []
        return self._dispatch([e for e in entries if e is not None and e.status in ("held", "pending")])

    @property
    def parked(self) -> list[str]:
        with self._lock:
            return list(self._parked)

    # -- waiting / closing --------------------------------------------------------------------------
    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every caller request finished or was refused; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.ledger.num_open():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every lane (graceful shutdown; requests still queued in a runtime are dropped)."""
        self._closed.set()
        for lane in self.lanes:
            if lane.alive:
                lane.retire(timeout_s)

    def __enter__(self) -> ServingRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reports from lanes (LaneOwner; pump / monitor threads) -------------------------------------
    def lane_metrics(self, lane: Lane, sample: Any, *, idle: bool = False) -> None:
        """Pass a lane's metric sample to ``on_lane_sample``, and to ``on_metrics`` unless it is an empty window
        of a lane other than the entry point (see the class docstring)."""
        if self._on_lane_sample is not None:
            self._on_lane_sample(lane.lane_id, sample)
        if self._on_metrics is None:
            return
        gear_id, members, routed = self._round_members()
        if lane.lane_id in members:
            merged = self._rounds.add(lane.lane_id, sample, members, routed)
            if merged is not None:
                self._on_metrics(merged)
        elif lane.gear.gear_id == gear_id and (members or lane.state == "warming"):
            return  # a new instance warming up, or beside merged ones a standby lane, of the serving gear: probes only
        elif not idle or sample.records_work or lane is self.active:
            self._on_metrics(sample)

    def _round_members(self) -> tuple[str | None, list[str], int]:
        """The entry point's gear and the lanes whose windows the serving stream merges (:class:`InstanceRound`):
        the live lanes of that gear that are routed to or draining (a scale-in's withdrawn instance, a pool
        growth's old pipeline), when there are at least two, else ``[]``; with how many of them are routed to
        (the merged sample's ``instances``)."""
        with self._lock:
            entry = self.active
            if entry is None:
                return None, [], 0
            gear_id = entry.gear.gear_id
            routed = [ln.lane_id for ln in self.instances if ln.gear.gear_id == gear_id]
            members = routed + [ln.lane_id for ln in self._lanes.values()
                                if ln.state == "draining" and ln.gear.gear_id == gear_id and ln.lane_id not in routed]
        if len(members) < 2:
            self._rounds.reset()
            return gear_id, [], len(routed)
        return gear_id, members, len(routed)

    def lane_tokens(self, lane: Lane, tokens: tuple[tuple[str, int, int], ...]) -> None:
        """Pass a lane's sampled tokens of caller requests (not the executor's probes) to ``on_tokens``."""
        if self._on_tokens is not None:
            for request_id, index, token_id in tokens:
                if not request_id.startswith(INTERNAL_PREFIX):
                    self._on_tokens(request_id, index, token_id)

    def lane_failed(self, lane: Lane, err: BaseException) -> None:
        """Keep the failed lane's delivered outputs, fail its probes, mark it failed, fall back if it was
        the entry point, and re-submit (or hold) its open requests."""
        for out in getattr(err, "finished", []) or []:  # delivered ones are dropped as duplicates
            self.ledger.finish(out, lane.lane_id)
        reason = f"{type(err).__name__}: {err}"
        self.ledger.fail_internal(lane.lane_id, reason)
        with self._lock:
            was_entry = lane is self.active
            lane.state = "failed"
            if not lane.forced:
                self.failures.append((lane.lane_id, reason))
            if lane in self._instances:
                self._instances.remove(lane)
            if was_entry:
                fb = self.fallback
                if fb is not None and fb.alive and fb is not lane:
                    self._active, fb.state = fb, "active"
                self.fallback = None
            if self.fallback is lane:
                self.fallback = None
            self._move_open(lane)
            self._forget_dead_lanes()
        self._flush_refusals()

    def lane_refused(self, lane: Lane, refusals: dict[str, str]) -> None:
        """Refuse each request for good (policy ``final``, probes) or park it for a later re-submission
        (policies ``park`` / ``fail``; ``fail`` also records the lane's health failure)."""
        for rid, reason in refusals.items():
            entry = self.ledger.find(rid)
            if entry is None:
                continue
            if entry.internal or lane.refusal_policy == "final" or entry.lane_id != lane.lane_id:
                if entry.lane_id == lane.lane_id:
                    self.ledger.refuse(rid, reason)
                continue
            with self._lock:
                self.ledger.hold(rid)
                self._parked.append(rid)
                if lane.refusal_policy == "fail" and lane.health_failure is None:
                    lane.health_failure = f"request {rid} refused: {reason}"

    def lane_gone(self, lane: Lane) -> None:
        """A lane was retired or killed: anything still open on it moves on."""
        self.ledger.fail_internal(lane.lane_id, f"lane {lane.lane_id} stopped")
        with self._lock:
            if self.fallback is lane:
                self.fallback = None
            if self._active is lane:
                self._active = None
            if lane in self._instances:
                self._instances.remove(lane)
            self._move_open(lane)
            self._forget_dead_lanes()
        self._flush_refusals()

    def _forget_dead_lanes(self) -> None:
        """Drop the retired or failed lanes added first, beyond :data:`DEAD_LANES_KEPT` (caller holds the lock)."""
        dead = [lane_id for lane_id, ln in self._lanes.items() if not ln.alive]
        for lane_id in dead[:max(0, len(dead) - DEAD_LANES_KEPT)]:
            del self._lanes[lane_id]

    def _poll_refusals(self) -> None:
        while not self._closed.wait(REFUSAL_POLL_S):
            for lane in self.lanes:
                if lane.alive:
                    try:
                        lane.poll_refusals()
                    except Exception:
                        pass
