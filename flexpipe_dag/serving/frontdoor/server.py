"""Run the front door: live pipeline instances behind a :class:`ServingRouter`, the API app, uvicorn.

The pipeline starts before the port is bound (uvicorn runs the app's lifespan first), so a client
that can connect finds it ready. With :class:`InstanceSettings` ``instances`` > 1, further instances
of the same gear start after it (:meth:`~flexpipe_dag.shift.instances.InstanceFleet.add_instance`:
each warmed up and verified before it is routed to), and with ``max_instances`` a
:class:`~flexpipe_dag.shift.fleet_control.FleetController` scales them out and in on the request rate,
in a background thread. SIGINT / SIGTERM drain: the scaler stops, new requests get 503, open ones
finish for up to ``drain_timeout_s``, then the pipelines stop. The server holds this host's
pipeline-runtime lock (:mod:`flexpipe_dag.runtime.host_lock`) for its life, as the Dagster runtime ops do.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from flexpipe_dag.control.fleet_scaler import FleetScalerConfig
from flexpipe_dag.core.errors import FlexPipeError, InputError
from flexpipe_dag.core.settings import check_number
from flexpipe_dag.shift.executor import ShiftConfig


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the front door listens.

    Attributes:
        host: address to bind; anything but a loopback address needs ``api_key``.
        port: TCP port (0: the kernel picks one; :attr:`FrontDoorServer.port` says which).
        api_key: the key ``/v1`` routes require (``Authorization: Bearer KEY``); None: no key.
        model_name: the id clients send as ``model`` and ``/v1/models`` lists.
        max_pending: open requests above which new ones get 429.
        drain_timeout_s: how long a shutdown waits for open requests.
        default_max_tokens: ``max_tokens`` of a chat (or batch line) that sets none; 0: the fair share of one KV
            lane (:attr:`~flexpipe_dag.serving.frontdoor.engine.FrontDoorEngine.fair_share_tokens`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "SmolLM2-135M-Instruct"
    max_pending: int = 256
    drain_timeout_s: float = 30.0
    default_max_tokens: int = 0

    def check(self) -> None:
        """Raises:
            InputError: a non-loopback ``host`` without an API key, a port outside 0..65535, or a negative
                ``default_max_tokens``."""
        if not 0 <= self.port <= 65535:
            raise InputError(None, "--port", f"expected 0..65535, got {self.port}")
        if self.default_max_tokens < 0:
            raise InputError(None, "--default-max-tokens", f"expected >= 1 (0: the fair share), got {self.default_max_tokens}")
        _check_bindable(self.host)
        if self.api_key is None and not _is_loopback(self.host):
            raise InputError(None, "--host", f"binding {self.host} exposes the API beyond this host: give "
                                              "--api-key-file (or bind 127.0.0.1)")


def _check_bindable(host: str) -> None:
    """``host`` resolves to an address of this host (a trial bind on a kernel-picked port, so the
    pipeline is not started for a server that could never listen).

    Raises:
        InputError: naming ``--host``.
    """
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise InputError(None, "--host", f"{host!r} does not resolve to an address ({exc})") from None
    try:
        with socket.socket(family, kind, proto) as trial:
            trial.bind(address)
    except OSError as exc:
        raise InputError(None, "--host", f"cannot listen on {host!r}: {exc.strerror or exc}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Default seconds between two fleet scaler samples of a server (``--scale-interval-s``; the runtime's metric period).
SCALE_INTERVAL_S = 2.0


@dataclass(frozen=True)
class InstanceSettings:
    """How many pipeline instances of the served gear run behind the router.

    Attributes:
        instances: instances started before the port is bound: the entry point and ``instances - 1``
            more of the same gear (>= 1).
        max_instances: None: the count stays. Else a fleet controller scales between 1 and this many
            (>= ``instances``) on the request rate the router accepts, over
            :func:`~flexpipe_dag.planner.fleet.replicated_plan` of the gear (which needs its measured
            envelope, ``rps_max`` req/s).
        scaler: the fleet scaler's figures (``sample_period_s`` is the scale interval, seconds).
        shift: warm-up, verify and drain figures of an instance's start and removal.
    """

    instances: int = 1
    max_instances: int | None = None
    scaler: FleetScalerConfig = field(default_factory=lambda: FleetScalerConfig(sample_period_s=SCALE_INTERVAL_S))
    shift: ShiftConfig = field(default_factory=ShiftConfig)

    @property
    def several(self) -> bool:
        """More than one instance may serve (``instances`` > 1, or a scaler)."""
        return self.instances > 1 or self.max_instances is not None

    def check(self, gear=None) -> None:
        """Raises:
            InputError: ``instances`` below 1, ``max_instances`` below ``instances``, a scaler dwell that
                never lets a scale-in pay back, or ``max_instances`` for a ``gear`` without a measured
                envelope (naming the flag)."""
        check_number(self.instances, None, "--instances", integer=True, ge=1, le=1024, unit="pipeline instances")
        if self.max_instances is None:
            return
        check_number(self.max_instances, None, "--max-instances", integer=True, ge=self.instances, le=1024,
                     unit=f"pipeline instances, at least --instances {self.instances}")
        cost_s = self.scaler.scale_in_cost_s
        if self.scaler.dwell_s <= cost_s:  # without a forecast a scale-in is expected to hold one dwell
            raise InputError(None, "--scale-dwell-s", f"got {self.scaler.dwell_s:g} s; expected more than the "
                                                      f"{cost_s:g} s of warm-up + drain a scale-in must pay back "
                                                      "(else instances are never given back)")
        if gear is not None:
            try:
                self.plan(gear)
            except InputError as exc:
                raise InputError(None, "--max-instances", f"gear {gear.gear_id}: {exc.problem}") from None

    def plan(self, gear):
        """The plan the scaler sizes over: ``max_instances`` copies of ``gear`` (None without ``max_instances``)."""
        from flexpipe_dag.planner.fleet import replicated_plan

        return None if self.max_instances is None else replicated_plan(gear, self.max_instances)


@dataclass(frozen=True)
class StoreLink:
    """How the front door joins the SQL store as a serving run (see
    :class:`~flexpipe_dag.serving.live_control.LiveControl`): its 2-s samples go to the store, where
    ``gear_shift_sensor`` reads them, and the shifts ``gear_shift`` runs request for ``run_key`` are
    applied here while traffic flows.

    Attributes:
        store: the :class:`~flexpipe_dag.sql.store.Store`.
        control: the resolved controller figures.
        run_key: this server's serving-run key.
        gears: gears a shift may go to (others are looked up in the store).
        control_interval_s: seconds between two control steps.
        batch_inflight: Batch API lines on the pipeline at once.
        batch_pause_above: open online requests above which no batch line is submitted.
        inline_control: the server decides its own shifts with the controller (no Dagster daemon needed);
            False: ``gear_shift_sensor`` decides and ``gear_shift`` runs request the shifts.
    """

    store: Any
    control: Any
    run_key: str
    gears: tuple = ()
    control_interval_s: float = 2.0
    batch_inflight: int = 8
    batch_pause_above: int = 8
    inline_control: bool = False


def check_several(instances: InstanceSettings, *, inline_control: bool, ray: bool) -> None:
    """Refuse what several instances do not mean one thing with: the controller's gear shifts (they move
    the entry point only, the others would stay on the old gear) and Ray placement (every instance would
    be placed on the same devices).

    Raises:
        InputError: naming ``--instances`` / ``--max-instances``.
    """
    if not instances.several:
        return
    flag = "--max-instances" if instances.max_instances is not None else "--instances"
    if inline_control:
        raise InputError(None, flag, "several instances and --inline-control do not mix: a gear shift moves the "
                                     "entry point only, the other instances would stay on the old gear; drop one")
    if ray:
        raise InputError(None, flag, "several instances and --ray do not mix: every instance would be placed on the "
                                     "gear's same devices; serve one instance per gear with Ray")


class FrontDoorServer:
    """The API server over ``runtime`` (a not yet started :class:`PipelineRuntime` built with
    ``stream_tokens=True``), for ``settings``; :meth:`run` blocks until a signal stops it.

    Args:
        runtime: the pipeline to serve.
        tokenizer, eos_token_ids, max_context_tokens: the model's (see :class:`FrontDoorEngine`).
        settings: :class:`ServerSettings`.
        link: the store to register in and take shifts from (None: a stand-alone server, one gear).
        log: where startup and shutdown lines go (stderr by default).
        instances: how many instances of ``runtime``'s gear serve, and whether a fleet controller scales
            them (default: one instance).

    Attributes:
        fleet: the :class:`~flexpipe_dag.shift.instances.InstanceFleet` over the router (once serving).
        scaler: the :class:`~flexpipe_dag.shift.fleet_control.FleetController` (with ``max_instances``).
        startup_failure: why the pipelines did not start (then :meth:`run` returns 1), or None.
    """

    def __init__(self, runtime, tokenizer, eos_token_ids: tuple[int, ...], max_context_tokens: int | None,
                 settings: ServerSettings, link: StoreLink | None = None, log=None,
                 instances: InstanceSettings | None = None):
        from flexpipe_dag.serving.frontdoor.engine import FrontDoorEngine
        from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics

        settings.check()
        if not runtime.options.stream_tokens:
            raise InputError(None, "runtime", "the front door needs a runtime built with stream_tokens=True")
        self.instances = instances or InstanceSettings()
        self.instances.check(runtime.gear)
        check_several(self.instances, inline_control=link is not None and link.inline_control,
                      ray=runtime.options.placement is not None)
        self.runtime, self.settings, self.link = runtime, settings, link
        self.fleet: Any = None
        self.scaler: Any = None
        self.startup_failure: str | None = None
        self.startup_refused = False  # the failure is a FlexPipeError: its reason alone is reported
        self._scaler_stop = threading.Event()
        self._scaler_thread: threading.Thread | None = None
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.engine = FrontDoorEngine(tokenizer, eos_token_ids, max_context_tokens, FrontDoorMetrics(),
                                      max_pending=settings.max_pending, default_max_tokens=settings.default_max_tokens)
        self.router: Any = None
        self.uvicorn: Any = None
        self.live: Any = None
        from flexpipe_dag.serving.frontdoor.app import BatchAPI

        self.batch_api = BatchAPI(link.store if link is not None else None)

    @property
    def port(self) -> int | None:
        """The bound port once serving (None before)."""
        servers = getattr(self.uvicorn, "servers", None)
        if not servers:
            return None
        return servers[0].sockets[0].getsockname()[1]

    def _on_metrics(self, sample) -> None:
        self.engine.metrics.observe_sample(sample)
        if self.live is not None:
            self.live.on_metrics(sample)

    async def _watch_pipeline(self) -> None:
        """Once a second: when the live pipeline has failed (a stage crashed or hung and no fallback took
        its traffic), end the open requests with a 503, say why, and stop the server with exit status 1,
        for its supervisor (systemd, Kubernetes) to start a fresh one, as vLLM's server does when its
        engine dies. Requests are not resubmitted: one that broke the pipeline would break the next."""
        while True:
            await asyncio.sleep(1.0)
            active = self.router.active if self.router is not None else None
            if active is not None and active.alive:
                continue
            reason = self.router.failures[-1][1] if self.router is not None and self.router.failures else \
                "no live pipeline"
            cut = self.engine.fail_open(f"the pipeline failed: {reason}")
            self.log(f"pipeline failed: {reason}; {cut} open request(s) ended with 503; stopping (exit status 1)")
            if self.uvicorn is not None:
                self.uvicorn.should_exit = True
            return

    def _on_shift_done(self, record: dict) -> None:
        self.engine.metrics.shifts.labels(record.get("trigger") or "manual", record["status"]).inc()

    async def _control_loop(self) -> None:
        """The store side, every ``control_interval_s``: samples, heartbeat, shift requests."""
        assert self.link is not None and self.live is not None
        while True:
            await asyncio.to_thread(self._control_step)
            await asyncio.sleep(self.link.control_interval_s)

    @property
    def endpoint(self) -> str | None:
        """The base URL clients use (``http://HOST:PORT/v1``) once bound, else None."""
        if self.port is None:
            return None
        import socket

        host = self.settings.host
        if host in ("0.0.0.0", "::", ""):  # every interface: the name others reach this host by
            host = socket.getfqdn()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

    def _control_step(self) -> None:
        if self.live.endpoint is None:
            self.live.endpoint = self.endpoint  # stored with the next heartbeat
        try:
            self.live.write_samples()
            self.live.step()
        except Exception as exc:  # a store hiccup must not stop serving; the next step tries again
            self.log(f"control step failed: {type(exc).__name__}: {exc}")

    @asynccontextmanager
    async def _lifespan(self, _app):
        from flexpipe_dag.serving.live_control import LiveControl
        from flexpipe_dag.shift.executor import GearExecutor
        from flexpipe_dag.shift.router import ServingRouter

        self.router = ServingRouter(**{**self.engine.router_callbacks(), "on_metrics": self._on_metrics})
        try:
            await asyncio.to_thread(self._start_pipelines)  # loads the stages: tens of seconds per instance
        except BaseException as exc:
            # a FlexPipeError is a refusal with its reason (no room, a bad gear): the reason is the message,
            # and uvicorn's copy of the traceback is left out (_QuietStartupFailure); anything else keeps both
            self.startup_refused = isinstance(exc, FlexPipeError)
            self.startup_failure = str(exc) if self.startup_refused else f"{type(exc).__name__}: {exc}"
            self.log(f"startup failed: {self.startup_failure}; stopping the pipelines (exit status 1)")
            await asyncio.to_thread(self.router.close)
            raise
        self.engine.attach(self.router)
        self.engine.metrics.set_live_gear(self.runtime.gear.gear_id)
        watch = asyncio.create_task(self._watch_pipeline())
        self._start_scaler()
        task = None
        if self.link is not None:
            executor = GearExecutor(self.router, options=self.runtime.options)
            refused = ("this server runs several instances of its gear; a gear shift would move only one of them"
                       if self.instances.several else None)
            self.live = LiveControl(self.link.store, self.link.control, self.router, executor, self.link.gears,
                                    self.link.run_key, inline_control=self.link.inline_control, log=self.log,
                                    on_shift_done=self._on_shift_done, shifts_refused=refused, keep_history=False)
            task = asyncio.create_task(self._control_loop())
            deciding = "decided here (inline control)" if self.link.inline_control else "from gear_shift runs"
            self.log(f"serving run {self.link.run_key}: samples to the store, shifts {deciding}")
            self._start_batches()
        try:
            yield
        finally:
            self._scaler_stop.set()  # no instance is added or removed while the server drains
            if self.batch_api.runner is not None:
                self.batch_api.runner.stop()  # its lines in flight have no result row: the next server serves them
            cut = await self.engine.drain(self.settings.drain_timeout_s)
            self.log(f"draining done ({cut} request(s) cut off); stopping the pipeline")
            watch.cancel()
            if self._scaler_thread is not None:  # a start under way ends within its warm-up deadline
                await asyncio.to_thread(self._scaler_thread.join)
            if task is not None:
                task.cancel()
                await asyncio.to_thread(self._wait_shift_then_end)
            await asyncio.to_thread(self.router.close)

    def _start_pipelines(self) -> None:
        """Open the entry point, then start the further instances of its gear one by one (each warmed up
        and verified before it is routed to).

        Raises:
            FlexPipeError: a pipeline did not start (the message says which and why).
        """
        from flexpipe_dag.shift.instances import InstanceFleet

        gear = self.runtime.gear
        self.router.open(self.runtime)
        self.log(f"gear {gear.gear_id} live: stages {gear.layer_ranges()}")
        self.fleet = InstanceFleet(self.router, self.runtime.ckpt, self.runtime.options, self.instances.shift)
        self.engine.fleet = self.fleet
        self.engine.metrics.instances.set_function(lambda: len(self.router.instances))
        for k in range(2, self.instances.instances + 1):
            lane_id = self.fleet.add_instance(gear)
            self.log(f"instance {k} of {self.instances.instances} live: {lane_id}")

    def _start_scaler(self) -> None:
        """With ``max_instances``: a fleet controller over the serving instances, sampling in a thread."""
        from flexpipe_dag.shift.fleet_control import FleetController

        plan = self.instances.plan(self.runtime.gear)
        if plan is None:
            return
        self.scaler = FleetController(self.fleet, plan, self.instances.scaler)
        self.scaler.adopt([lane.lane_id for lane in self.router.instances])
        self._scaler_thread = threading.Thread(target=self._scale, name="flexpipe-fleet-scaler", daemon=True)
        self._scaler_thread.start()
        c = self.instances.scaler
        self.log(f"fleet scaler: 1..{self.instances.max_instances} instances of {plan.instances[0].rps_max:g} req/s "
                 f"each, a sample every {c.sample_period_s:g} s, dwell {c.dwell_s:g} s")

    def _scale(self) -> None:
        """The scaler's thread: one step per ``sample_period_s`` until the server stops; each applied
        change is logged and counted in ``flexpipe_instance_changes_total``."""
        ctl, stop = self.scaler, self._scaler_stop
        while not stop.wait(self.instances.scaler.sample_period_s):
            before, errors = len(ctl.lane_ids), len(ctl.errors)
            try:
                decision = ctl.step()
            except Exception as exc:  # e.g. an instance that died meanwhile: the next sample tries again
                self.log(f"fleet scaler step failed: {type(exc).__name__}: {exc}")
                continue
            after = len(ctl.lane_ids)
            for error in ctl.errors[errors:]:
                self.log(f"fleet scaler: {error}")
            if after != before:
                self.engine.metrics.instance_changes.labels("out" if after > before else "in").inc()
                self.log(f"fleet scaler: {decision.reason}; serving {ctl.lane_ids}")

    def _start_batches(self) -> None:
        from flexpipe_dag.serving.frontdoor.batches import BatchRunner

        assert self.link is not None
        runner = BatchRunner(self.link.store, self.engine, self.settings.model_name,
                             max_inflight=self.link.batch_inflight, pause_above_online=self.link.batch_pause_above,
                             log=self.log, run_key=self.link.run_key)
        self.engine.other_requests = (runner.on_result, runner.on_refused, runner.on_token)
        self.batch_api.runner = runner
        runner.start()

    def _wait_shift_then_end(self) -> None:
        thread = self.live.shift_thread
        if thread is not None:
            thread.join(timeout=self.settings.drain_timeout_s)
        self.live.write_samples()
        self.live.end()

    def run(self) -> int:
        """Serve until SIGINT / SIGTERM (holding this host's pipeline-runtime lock meanwhile); returns the
        exit status: 0, or 1 when the pipeline failed or a pipeline instance did not start."""
        import signal

        import uvicorn

        from flexpipe_dag.runtime.host_lock import hold_runtime_lock
        from flexpipe_dag.serving.frontdoor.app import create_app

        app = create_app(self.engine, self.settings.model_name, self.settings.api_key, lifespan=self._lifespan,
                         batch_api=self.batch_api)
        config = uvicorn.Config(app, host=self.settings.host, port=self.settings.port, log_level="info", access_log=False,
                                timeout_graceful_shutdown=int(self.settings.drain_timeout_s) + 5)
        engine = self.engine

        class DrainingServer(uvicorn.Server):
            """uvicorn's server, which marks the engine draining the moment a stop signal comes: uvicorn
            then stops accepting connections and waits for open requests; a new request on a connection
            already open gets 503 meanwhile, and /ready says 503."""

            def handle_exit(self, sig, frame) -> None:
                # uvicorn's own handler also records the signal and raises it again once serving ends
                # (uvicorn >= 0.29), which killed this process before the runtime lock's holder file was
                # removed and before run() returned its status; the stop it asks for is the same
                engine.draining = True
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True  # a second Ctrl-C: stop waiting for open requests
                else:
                    self.should_exit = True

        self.uvicorn = DrainingServer(config)
        quiet = _QuietStartupFailure(self)
        logging.getLogger("uvicorn.error").addFilter(quiet)
        with hold_runtime_lock("flexpipe serve", self.log):  # the holder line adds pid, host, since
            try:
                self.uvicorn.run()
            except SystemExit:  # uvicorn's own exit (status 3) when the startup failed: ours says 1 and why
                if self.startup_failure is None:
                    raise
        return 1 if self.engine.failure or self.startup_failure else 0


class _QuietStartupFailure(logging.Filter):
    """Drops uvicorn's report of a startup the server refused with a reason (a
    :class:`~flexpipe_dag.core.errors.FlexPipeError`, already logged in one line): its traceback and
    "Application startup failed" line. Other failures keep them."""

    def __init__(self, server: FrontDoorServer):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(self.server, "startup_refused", False):
            return True
        message = record.getMessage()
        return not (message.startswith("Traceback") or "Application startup failed" in message)
