"""The shift executor: move live traffic from the running gear to a new one, or roll back.

:meth:`GearExecutor.shift` runs the design's steps on the real runtime, each under a timeout, and
returns a :class:`ShiftOutcome` for the shift event (``store.update_shift_event``). A step that
fails or hangs becomes a rollback; no step waits without a deadline.

Shadow / degraded mode (both gears resident; :func:`~flexpipe_dag.shift.residency.plan_residency`):

1. **warm-up** - start the new gear's :class:`PipelineRuntime` (own processes; the old gear keeps
   serving) and run ``warmup_requests`` real requests through it, one at a time (concurrency 1),
   then sleep so its busy time is at most ``warmup_compute_fraction`` (design seed 20 %) of the
   wall time: on a CPU host each stage process runs ``threads_per_rank`` (1) thread, so warm-up
   uses at most that fraction of one core per stage. In ``degraded`` mode the new gear starts with
   the small KV pool the plan allows.
2. **verify** - the warm-up's greedy tokens for a known prompt must equal the old gear's tokens for
   the same prompt (sent to the old gear as a low-priority internal request at step 1).
3. **switch** - under the router's lock the entry point becomes the new gear: no new admission to
   the old gear, requests already there finish there (those queued in its scheduler too, since a
   runtime cannot give a request back).
4. **drain** - wait until the old gear finished everything it held.
5. **health window** - for ``health_window_s`` the new gear answers a 1-token canary every
   ``probe_interval_s`` (its first token must match the verified one); a crashed / raising / hung
   stage (the runtime's watchdog, ``step_timeout_s``), a canary not back within
   ``probe_timeout_s``, or a refused request fails it. The old gear stays alive (double buffer)
   until the window passes.
6. **release** - shut the old gear's processes down (their memory goes back to the OS / device).
7. **grow** (degraded only) - hold new admissions at the router, let the new gear's in-flight
   requests finish, ``reconfigure`` it to the full KV pool (the runtime reloads the stage layers
   with the pool; same processes), release the held requests. Requests refused by the small pool
   meanwhile were parked and are re-submitted now.

Rollback: before the switch, the new pipeline is stopped and nothing else changes. After it, the
entry point returns to the old gear (still alive until the window passed), the new pipeline's
stage processes are killed, and every caller request it had not finished is re-submitted to the
old gear; outputs it finished were delivered and are not repeated. If the old gear is gone (it
failed, or was released before a KV growth failed) it is restarted from its gear and the held
requests go to it.

Cold mode (memory too short for even the new weights next to the old gear): hold new admissions,
drain the old gear, then ``reconfigure`` the same processes to the new gear when the stages and
their replica counts are unchanged (``in_place``) or stop it and start the new gear (``restart``); verify, release the held
requests, watch the health window. There is no double buffer: rollback restarts the old gear.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flexpipe_dag.core.errors import FlexPipeError
from flexpipe_dag.shift.residency import ResidencyPlan, plan_residency

if TYPE_CHECKING:  # pragma: no cover
    from flexpipe_dag.core.gear import Gear
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from flexpipe_dag.shift.lane import Lane
    from flexpipe_dag.shift.router import ServingRouter

#: The known prompt whose greedy answer must not change across a shift.
VERIFY_PROMPT = "What is the capital of France?"

ShiftStatus = Literal["done", "rolled_back", "failed"]
ShiftStep = Literal["plan", "warmup", "verify", "switch", "drain", "health", "release", "grow"]


class ShiftConfig(BaseModel):
    """Figures of one shift (all seconds unless named otherwise).

    ``warmup_compute_fraction``: design seed 0.2 (at most 20 % of a device's compute for warm-up).
    ``memory_reserve_fraction``: design seed 10-15 % kept free. ``step_timeout_s``: the runtime
    watchdog's per-step limit for the new gear (``None``: the options' own).
    """

    model_config = ConfigDict(extra="forbid")

    warmup_requests: int = Field(2, ge=1)
    warmup_max_new_tokens: int = Field(4, ge=1)
    warmup_compute_fraction: float = Field(0.2, gt=0, le=1)
    warmup_timeout_s: float = Field(300.0, gt=0)
    drain_timeout_s: float = Field(120.0, gt=0)
    health_window_s: float = Field(5.0, ge=0)
    probe_interval_s: float = Field(1.0, gt=0)
    probe_timeout_s: float = Field(30.0, gt=0)
    release_timeout_s: float = Field(30.0, gt=0)
    grow_timeout_s: float = Field(300.0, gt=0)
    step_timeout_s: float | None = Field(None, gt=0)
    min_degraded_kv_tokens: int = Field(256, ge=1)
    memory_reserve_fraction: float = Field(0.10, ge=0, lt=1)
    verify_prompt_token_ids: list[int] | None = None


@dataclass
class ShiftOutcome:
    """What a shift did, for the shift event and the health tags.

    Attributes:
        status: ``done`` (traffic on the new gear), ``rolled_back`` (traffic on the old gear; the
            new gear failed a step), ``failed`` (nothing started: bad request or no live pipeline).
        mode: ``shadow``, ``degraded``, ``in_place`` or ``restart``.
        failed_step: the step that failed (``None`` when done).
        reason: one line, what happened.
        timings_s: seconds per step (``warmup``, ``verify``, ``switch``, ``drain``, ``health``,
            ``release``, ``grow``, ``rollback``) and ``total``; a step that did not run is absent.
        requests_moved: caller requests re-submitted from one pipeline to another.
        requests_on_new: caller requests submitted to the new gear during the shift (moves included).
        new_gear_at_fault: the new gear itself failed (crash, hang, refusal, wrong tokens, would
            not start): mark it unhealthy. False for a drain timeout of the old gear.
        details: residency plan, KV sizes, warm-up figures, lane failures.
    """

    status: ShiftStatus
    from_gear_id: str | None
    to_gear_id: str
    mode: str
    reason: str
    failed_step: str | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    requests_moved: int = 0
    requests_on_new: int = 0
    new_gear_at_fault: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def unhealthy_gear_id(self) -> str | None:
        """The gear to mark unhealthy (``store.mark_unhealthy``), or ``None``."""
        return self.to_gear_id if self.status == "rolled_back" and self.new_gear_at_fault else None

    @property
    def failure_kind(self) -> str | None:
        """``oom`` / ``timeout`` / ``refused`` / ``wrong_output`` / ``crashed_stage`` for a rollback
        (the ``failure`` of ``store.mark_unhealthy``), ``None`` otherwise."""
        if self.status == "done":
            return None
        why = self.reason.lower()
        if "outofmemory" in why or "out of memory" in why:
            return "oom"
        if any(w in why for w in ("watchdog", "timed out", "did not load", "within", "not answered")):
            return "timeout"
        if "refused" in why:
            return "refused"
        if self.failed_step == "verify" or "greedy tokens" in why:
            return "wrong_output"
        return "crashed_stage"

    def to_details(self) -> dict[str, Any]:
        """JSON-ready dict for ``Store.update_shift_event(event_id, status, details)``."""
        return {**dataclasses.asdict(self), "failure_kind": self.failure_kind}


class _StepFailed(FlexPipeError):
    """Internal: a step failed; carries the step and whether the new gear is to blame."""

    def __init__(self, step: str, reason: str, at_fault: bool = True):
        self.step, self.reason, self.at_fault = step, reason, at_fault
        super().__init__(f"{step}: {reason}")


class GearExecutor:
    """Runs shifts on a :class:`ServingRouter`'s live pipeline (one shift at a time).

    Args:
        router: the serving front; its active lane is the gear being left.
        config: :class:`ShiftConfig`.
        options: runtime options for new pipelines (default: the active pipeline's).
    """

    def __init__(self, router: ServingRouter, config: ShiftConfig | None = None,
                 options: RuntimeOptions | None = None):
        self.router = router
        self.config = config or ShiftConfig()
        self.options = options
        self._lock = threading.Lock()
        self._verify_ids: list[int] | None = None

    # -- public -------------------------------------------------------------------------------------
    def shift(self, new_gear: Gear, options: RuntimeOptions | None = None) -> ShiftOutcome:
        """Move traffic to ``new_gear`` (see the module docstring for the steps).

        Args:
            new_gear: the gear to run; same model as the running one.
            options: runtime options for the new pipeline only (e.g. a fault hook in tests).

        Returns a :class:`ShiftOutcome`; never raises for a failed step (that is a rollback). A ``new_gear`` that
        is already serving is refused without a migration (``failed``, "stale: <gear> is already serving").
        Raises ``RuntimeError`` if another shift is running on this executor.
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("a shift is already running on this executor")
        try:
            return self._shift(new_gear, options)
        finally:
            self._lock.release()

    def start_warm_lane(self, gear: Gear, ckpt, options: RuntimeOptions | None = None,
                        reference: Lane | None = None) -> Lane:
        """Steps 1-2 of a shadow shift without the switch: start ``gear``'s pipeline beside the live ones,
        run the warm-up requests through it and, when a live ``reference`` lane is given, check that its
        greedy tokens for the known prompt equal the reference's. The returned lane is ``warming`` (it
        serves probes only) until the caller routes to it (:meth:`ServingRouter.route_to`).

        Args:
            gear: the gear to start (the fit of its stages is checked first).
            ckpt: the model's :class:`~flexpipe_dag.runtime.model_loader.Checkpoint`.
            options: runtime options (default: the executor's); start and step limits as for a shift.
            reference: a live lane of the same model whose greedy answer the new one must match.

        Raises:
            InputError, InfeasibleError: the gear does not fit its devices (nothing started).
            FlexPipeError: the pipeline did not start, warm up or verify within ``warmup_timeout_s``
                (its processes are stopped; the message names the step).
            RuntimeError: a shift or another start is running on this executor.
        """
        from flexpipe_dag.runtime.pipeline import RuntimeOptions, check_gear_fits

        if not self._lock.acquire(blocking=False):
            raise RuntimeError("a shift or an instance start is already running on this executor")
        try:
            cfg = self.config
            opts = self._new_options(options or self.options or RuntimeOptions())
            check_gear_fits(gear, ckpt, opts)
            self._verify_request("tokenize", 1, ckpt)  # tokenizer load stays outside the step deadlines
            deadline = time.monotonic() + cfg.warmup_timeout_s
            ref_probe = None
            if reference is not None and reference.alive:
                ref_probe = self.router.submit_probe(
                    reference, self._verify_request("ref", cfg.warmup_max_new_tokens, ckpt, priority=1))
            lane = self._start_lane(gear, ckpt, opts, deadline)
            try:
                warm = self._warm_up(lane, ckpt, deadline)
                if ref_probe is not None:
                    ref = self._probe_result(ref_probe, deadline, "verify", "reference instance's answer",
                                             at_fault=False)
                    self._check_tokens(warm, ref.output_token_ids, "verify")
            except BaseException:
                lane.force_stop()
                raise
            return lane
        finally:
            self._lock.release()

    # -- the steps ----------------------------------------------------------------------------------
    def _shift(self, new_gear: Gear, options: RuntimeOptions | None) -> ShiftOutcome:
        from flexpipe_dag.runtime.pipeline import check_gear_fits

        t_start = time.monotonic()
        old = self.router.active
        moved0 = self.router.ledger.moved
        out = ShiftOutcome("failed", old.gear.gear_id if old else None, new_gear.gear_id, "shadow", "")
        self._new_lane: Lane | None = None  # the lane the shift moves traffic to, once started
        self._new_base = 0

        def finish(status: ShiftStatus, reason: str, step: str | None = None, at_fault: bool = False) -> ShiftOutcome:
            out.status, out.reason, out.failed_step, out.new_gear_at_fault = status, reason, step, at_fault
            out.requests_moved = self.router.ledger.moved - moved0
            if self._new_lane is not None:
                out.requests_on_new = self.router.ledger.num_admitted_to(self._new_lane.lane_id) - self._new_base
            out.timings_s["total"] = round(time.monotonic() - t_start, 4)
            out.details["lane_failures"] = [f"{lid}: {why.splitlines()[0]}" for lid, why in self.router.failures]
            return out

        if old is None or not old.alive:
            return finish("failed", "no live pipeline to shift from", "plan")
        if old.gear.gear_id == new_gear.gear_id:  # a stale request: never migrate to the gear already serving
            return finish("failed", f"stale: {new_gear.gear_id} is already serving", "plan")
        ckpt = old.runtime.ckpt
        opts = self._new_options(options or self.options or old.runtime.options)
        try:
            check_gear_fits(new_gear, ckpt, opts)
            plan = self._plan(old.runtime, new_gear, ckpt, opts)
        except FlexPipeError as exc:
            return finish("failed", f"{type(exc).__name__}: {exc}", "plan", at_fault=False)
        out.details["residency"] = dataclasses.asdict(plan)
        self._verify_request("tokenize", 1, ckpt)  # tokenizer load stays outside the step deadlines
        if plan.mode == "cold":
            return self._shift_cold(old, new_gear, ckpt, opts, out, finish)
        out.mode = plan.mode
        return self._shift_shadow(old, new_gear, ckpt, opts, plan, out, finish)

    def _shift_shadow(self, old: Lane, new_gear: Gear, ckpt, opts, plan: ResidencyPlan, out: ShiftOutcome,
                      finish) -> ShiftOutcome:
        cfg, router = self.config, self.router
        warm_gear = new_gear if plan.mode == "shadow" else new_gear.model_copy(
            update={"kv_capacity_tokens": plan.warm_kv_tokens})
        out.details.update(warm_kv_tokens=plan.warm_kv_tokens, full_kv_tokens=plan.full_kv_tokens)
        new: Lane | None = None
        switched = False
        try:
            # 1-2. warm-up and verify (the old gear serves meanwhile)
            t = time.monotonic()
            deadline = t + cfg.warmup_timeout_s
            ref_probe = router.submit_probe(old, self._verify_request("ref", cfg.warmup_max_new_tokens, ckpt,
                                                                      priority=1))
            new = self._start_lane(warm_gear, ckpt, opts, deadline)
            out.details["start_s"] = round(time.monotonic() - t, 4)
            warm = self._warm_up(new, ckpt, deadline, out)
            out.timings_s["warmup"] = round(time.monotonic() - t, 4)
            t = time.monotonic()
            ref = self._probe_result(ref_probe, deadline, "verify", "old gear's reference", at_fault=False)
            self._check_tokens(warm, ref.output_token_ids, "verify")
            out.timings_s["verify"] = round(time.monotonic() - t, 4)
            # 3. switch
            new.refusal_policy = "park" if plan.mode == "degraded" else "fail"
            router.fallback = old if old.alive else None
            t = time.monotonic()
            self._new_lane = new
            router.switch_to(new)
            switched = True
            out.timings_s["switch"] = round(time.monotonic() - t, 6)
            router.release_held()  # requests held after an old-gear failure during warm-up
            # 4. drain the old gear (in-flight requests finish there)
            t = time.monotonic()
            self._drain(old, new, cfg.drain_timeout_s)
            out.timings_s["drain"] = round(time.monotonic() - t, 4)
            if old.alive:
                old.state = "standby"
            # 5. health window, old gear kept alive as the rollback target
            t = time.monotonic()
            self._health_window(new, ref.output_token_ids[:1], ckpt)
            out.timings_s["health"] = round(time.monotonic() - t, 4)
        except _StepFailed as exc:
            return self._rollback(old, new, switched, exc, out, finish)
        router.fallback = None
        # 6. release the old gear
        t = time.monotonic()
        if old.alive:
            old.retire(cfg.release_timeout_s)
        out.timings_s["release"] = round(time.monotonic() - t, 4)
        # 7. grow the KV pool (degraded mode)
        if plan.mode == "degraded":
            t = time.monotonic()
            try:
                note = self._grow(new, new_gear)
            except _StepFailed as exc:
                return self._restart_old(old.gear, ckpt, old.runtime.options, exc, out, finish)
            out.timings_s["grow"] = round(time.monotonic() - t, 4)
            if note:
                out.details["kv_growth"] = note
            else:
                out.details["kv_grown_to_tokens"] = plan.full_kv_tokens
        new.refusal_policy = "final"
        router.resubmit_parked()
        return finish("done", f"traffic on {new_gear.gear_id} ({out.mode})")

    # -- step helpers -------------------------------------------------------------------------------
    def _new_options(self, base: RuntimeOptions) -> RuntimeOptions:
        cfg = self.config
        step_timeout_s = base.step_timeout_s if cfg.step_timeout_s is None else cfg.step_timeout_s
        return dataclasses.replace(base, start_timeout_s=min(base.start_timeout_s, cfg.warmup_timeout_s),
                                   step_timeout_s=step_timeout_s)

    def _plan(self, old_rt: PipelineRuntime, new_gear: Gear, ckpt, opts) -> ResidencyPlan:

        from flexpipe_dag.runtime.pipeline import kv_num_blocks, stage_memory_bytes

        old_rows = stage_memory_bytes(old_rt.gear, ckpt, old_rt.options.dtype, old_rt.options.device)
        new_rows = stage_memory_bytes(new_gear, ckpt, opts.dtype, opts.device)
        full = kv_num_blocks(new_gear) * new_gear.kv_block_size_tokens
        from flexpipe_dag.core.host import host_memory_bytes

        host = host_memory_bytes()
        return plan_residency(old_rows, new_rows, opts.device_memory_bytes or {}, host, full_kv_tokens=full,
                              block_size_tokens=new_gear.kv_block_size_tokens,
                              min_kv_tokens=min(self.config.min_degraded_kv_tokens, full),
                              reserve_fraction=self.config.memory_reserve_fraction)

    def _start_lane(self, gear: Gear, ckpt, opts, deadline: float) -> Lane:
        """Start a pipeline for ``gear`` within ``deadline`` and add it to the router as a warming lane."""
        from flexpipe_dag.runtime.pipeline import PipelineRuntime

        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _StepFailed("warmup", "warm-up timed out before the new gear could start")
        start_timeout_s = min(opts.start_timeout_s, remaining)
        rt = PipelineRuntime(gear, ckpt, dataclasses.replace(opts, start_timeout_s=start_timeout_s))
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                rt.start()
            except BaseException as exc:
                box["error"] = exc

        th = threading.Thread(target=run, name="flexpipe-shift-start", daemon=True)
        th.start()
        th.join(timeout=remaining + 10.0)  # the runtime enforces start_timeout_s itself; this is a backstop
        if th.is_alive() or "error" in box:
            if th.is_alive():
                _kill_runtime(rt)
                reason = f"new gear did not start within {remaining:.1f} s"
            else:
                reason = f"new gear failed to start: {box['error']}"
            raise _StepFailed("warmup", reason)
        return self.router.add_lane(rt, state="warming")

    def _warm_up(self, lane: Lane, ckpt, deadline: float, out: ShiftOutcome | None = None) -> list[list[int]]:
        """Warm-up requests one at a time with a duty cycle of ``warmup_compute_fraction``."""
        cfg = self.config
        tokens, busy = [], 0.0
        for i in range(cfg.warmup_requests):
            t = time.monotonic()
            probe = self.router.submit_probe(lane, self._verify_request(f"warm{i}", cfg.warmup_max_new_tokens, ckpt))
            res = self._probe_result(probe, deadline, "warmup", "warm-up request")
            took = time.monotonic() - t
            busy += took
            tokens.append(list(res.output_token_ids))
            if i + 1 < cfg.warmup_requests:
                idle = took * (1.0 / cfg.warmup_compute_fraction - 1.0)
                time.sleep(max(0.0, min(idle, deadline - time.monotonic())))
        if out is not None:
            out.details.update(warmup_requests=cfg.warmup_requests, warmup_busy_s=round(busy, 4),
                               warmup_compute_fraction=cfg.warmup_compute_fraction)
        return tokens

    def _check_tokens(self, got: list[list[int]], want: list[int], step: str) -> None:
        for toks in got:
            if list(toks) != list(want[:len(toks)]) or len(toks) > len(want):
                raise _StepFailed(step, f"new gear's greedy tokens {toks} differ from the old gear's {list(want)}")

    def _drain(self, old: Lane, new: Lane, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while old.alive and self.router.ledger.has_open(old.lane_id):
            self._check_new(new, "drain")
            if time.monotonic() > deadline:
                raise _StepFailed("drain", f"old gear still held {self.router.ledger.num_open(old.lane_id)} "
                                           f"requests after {timeout_s:.1f} s", at_fault=False)
            time.sleep(0.02)
        self._check_new(new, "drain")

    def _wait_empty(self, lane: Lane, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while lane.alive and self.router.ledger.has_open(lane.lane_id):
            if time.monotonic() > deadline:
                held = self.router.ledger.num_open(lane.lane_id)
                raise _StepFailed("drain", f"{lane.gear.gear_id} still held {held} "
                                           f"requests after {timeout_s:.1f} s", at_fault=False)
            time.sleep(0.02)

    def _health_window(self, new: Lane, first_token: list[int], ckpt) -> None:
        cfg = self.config
        end = time.monotonic() + cfg.health_window_s
        probes: list = []
        next_probe = time.monotonic()
        while True:
            now = time.monotonic()
            self._check_new(new, "health")
            for p, sent in probes:
                if p.done:
                    continue
                if now - sent > cfg.probe_timeout_s:
                    raise _StepFailed("health", f"canary {p.request_id} not answered within "
                                                f"{cfg.probe_timeout_s:.1f} s")
            if now >= end and all(p.done for p, _ in probes):
                break
            if now >= end + cfg.probe_timeout_s:
                raise _StepFailed("health", "canaries still open after the window")
            if now < end and now >= next_probe:
                probes.append((self.router.submit_probe(new, self._verify_request("canary", 1, ckpt)), now))
                next_probe = now + cfg.probe_interval_s
            for p, _ in probes:
                if p.done and p.error is None:
                    self._check_tokens([p.output.output_token_ids], first_token, "health")
                elif p.done and p.error is not None and new.failure is None:
                    raise _StepFailed("health", f"canary failed: {p.error}")
            time.sleep(0.02)
        self._check_new(new, "health")

    def _check_new(self, new: Lane, step: str) -> None:
        new.poll_refusals()
        if new.failure is not None:
            raise _StepFailed(step, f"new gear failed: {str(new.failure).splitlines()[0]}")
        if new.health_failure is not None:
            raise _StepFailed(step, f"new gear failed its health check: {new.health_failure}")
        if not new.alive:
            raise _StepFailed(step, f"new gear is {new.state}")

    def _grow(self, new: Lane, full_gear: Gear) -> str | None:
        """Degraded mode: hold, let the new gear finish its requests, reconfigure to the full KV pool.

        Returns ``None`` when grown, or a note when the lane did not empty in time (it keeps
        serving with the small pool). Raises ``_StepFailed`` if the reconfiguration killed it."""
        cfg, router = self.config, self.router
        router.hold()
        try:
            new.run_exclusive(lambda rt: rt.reconfigure(full_gear, timeout_s=cfg.grow_timeout_s), cfg.grow_timeout_s)
        except TimeoutError as exc:
            router.release_held()
            return f"KV pool not grown (the gear keeps its warm-up pool): {exc}"
        except Exception as exc:
            raise _StepFailed("grow", f"KV pool growth failed: {str(exc).splitlines()[0]}") from exc
        router.release_held()
        return None

    # -- rollback -----------------------------------------------------------------------------------
    def _rollback(self, old: Lane, new: Lane | None, switched: bool, exc: _StepFailed, out: ShiftOutcome,
                  finish) -> ShiftOutcome:
        router = self.router
        t = time.monotonic()
        if switched and old.alive:
            router.switch_to(old)  # the entry point returns to the old gear first ...
        router.fallback = None
        if new is not None and new.alive:
            new.force_stop()  # ... then the new gear dies; its open requests move to the entry point
        elif new is not None:
            router.move_open(new)
        if not old.alive:
            return self._restart_old(old.gear, old.runtime.ckpt, old.runtime.options, exc, out, finish)
        router.release_held()
        router.resubmit_parked()
        out.timings_s["rollback"] = round(time.monotonic() - t, 4)
        return finish("rolled_back", exc.reason, exc.step, exc.at_fault)

    def _restart_old(self, old_gear: Gear, ckpt, opts, exc: _StepFailed, out: ShiftOutcome, finish) -> ShiftOutcome:
        """The old gear is gone: start it again and give it every held request (no double buffer left)."""
        from flexpipe_dag.runtime.pipeline import PipelineRuntime

        t = time.monotonic()
        router = self.router
        if router.active is not None and router.active.alive:
            router.active.force_stop()
        router.hold()
        try:
            lane = router.open(PipelineRuntime(old_gear, ckpt, dataclasses.replace(opts, fault={})))
        except Exception as err:
            out.timings_s["rollback"] = round(time.monotonic() - t, 4)
            return finish("failed", f"{exc.reason}; restarting the old gear failed too: {err}", exc.step,
                          exc.at_fault)
        lane.refusal_policy = "final"
        router.resubmit_parked()
        out.details["old_gear_restarted"] = True
        out.timings_s["rollback"] = round(time.monotonic() - t, 4)
        return finish("rolled_back", f"{exc.reason} (old gear restarted: it had been released)", exc.step,
                      exc.at_fault)

    # -- cold mode ----------------------------------------------------------------------------------
    def _shift_cold(self, old: Lane, new_gear: Gear, ckpt, opts, out: ShiftOutcome, finish) -> ShiftOutcome:
        cfg, router = self.config, self.router
        in_place = [st.replicas for st in new_gear.stages] == [st.replicas for st in old.gear.stages]
        out.mode = "in_place" if in_place else "restart"
        old_gear = old.gear
        try:
            t = time.monotonic()
            deadline = t + cfg.warmup_timeout_s
            ref = self._probe_result(router.submit_probe(old, self._verify_request("ref", cfg.warmup_max_new_tokens,
                                                                                  ckpt, priority=1)),
                                     deadline, "verify", "old gear's reference", at_fault=False)
            out.timings_s["verify_reference"] = round(time.monotonic() - t, 4)
            router.hold()  # the entry point closes: new requests wait in the router
            t = time.monotonic()
            self._wait_empty(old, cfg.drain_timeout_s)
            out.timings_s["drain"] = round(time.monotonic() - t, 4)
        except _StepFailed as exc:
            router.release_held()
            return finish("rolled_back", exc.reason, exc.step, exc.at_fault)
        try:
            t = time.monotonic()
            self._new_base = self.router.ledger.num_admitted_to(old.lane_id) if in_place else 0
            if in_place:
                old.run_exclusive(lambda rt: rt.reconfigure(new_gear, timeout_s=cfg.warmup_timeout_s),
                                  cfg.warmup_timeout_s)
                new = old
            else:
                old.retire(cfg.release_timeout_s)
                out.timings_s["release"] = round(time.monotonic() - t, 4)
                t = time.monotonic()
                new = self._start_lane(new_gear, ckpt, opts, time.monotonic() + cfg.warmup_timeout_s)
            warm = self._warm_up(new, ckpt, time.monotonic() + cfg.warmup_timeout_s, out)
            self._check_tokens(warm, ref.output_token_ids, "verify")
            out.timings_s["warmup"] = round(time.monotonic() - t, 4)
            t = time.monotonic()
            self._new_lane = new
            if new is not old:
                router.switch_to(new)
            new.refusal_policy = "fail"
            router.release_held()
            out.timings_s["switch"] = round(time.monotonic() - t, 6)
            t = time.monotonic()
            self._health_window(new, ref.output_token_ids[:1], ckpt)
            out.timings_s["health"] = round(time.monotonic() - t, 4)
        except _StepFailed as exc:
            return self._restart_old(old_gear, ckpt, old.runtime.options, exc, out, finish)
        except Exception as exc:
            return self._restart_old(old_gear, ckpt, old.runtime.options,
                                     _StepFailed("warmup", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"),
                                     out, finish)
        new.refusal_policy = "final"
        router.resubmit_parked()
        return finish("done", f"traffic on {new_gear.gear_id} ({out.mode}: {out.details['residency']['reason']})")

    # -- probes -------------------------------------------------------------------------------------
    def _verify_request(self, kind: str, max_new_tokens: int, ckpt, priority: int = 0):
        from flexpipe_dag.runtime.scheduler import Request

        if self._verify_ids is None:
            if self.config.verify_prompt_token_ids:
                self._verify_ids = list(self.config.verify_prompt_token_ids)
            else:
                enc = ckpt.tokenizer().apply_chat_template([{"role": "user", "content": VERIFY_PROMPT}],
                                                           add_generation_prompt=True, tokenize=True, return_dict=True)
                self._verify_ids = list(enc["input_ids"])
        return Request(self.router.probe_id(kind), list(self._verify_ids), max_new_tokens, priority=priority,
                       eos_token_ids=tuple(ckpt.eos_token_ids()), probe=True)

    def _probe_result(self, probe, deadline: float, step: str, what: str, at_fault: bool = True):
        try:
            return probe.result(deadline - time.monotonic())
        except TimeoutError as exc:
            raise _StepFailed(step, f"{what} timed out: {exc}", at_fault) from exc
        except RuntimeError as exc:
            raise _StepFailed(step, f"{what} failed: {str(exc).splitlines()[0]}", at_fault) from exc



def _kill_runtime(rt: PipelineRuntime) -> None:
    """Stop a runtime whose start() hangs: kill its stage processes, then shut the rest down."""
    import os
    import signal
    from contextlib import suppress

    for pid in ([] if rt.remote_stages else rt.stage_pids()):  # a remote stage's pid is another host's
        with suppress(ProcessLookupError, TypeError):
            os.kill(pid, signal.SIGKILL)
    with suppress(Exception):
        rt.shutdown(timeout_s=1.0)
