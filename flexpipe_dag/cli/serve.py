"""``flexpipe serve``: the OpenAI-compatible front door over a live pipeline.

``flexpipe serve --stages 2`` loads SmolLM2-135M-Instruct into a two-stage CPU pipeline and serves
``/v1/completions``, ``/v1/chat/completions`` (streaming too), ``/v1/models``, ``/health``,
``/ready`` and ``/metrics`` on 127.0.0.1:8000. Any OpenAI client works::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=[...])

Binding another address needs ``--api-key-file`` (the key clients send as their API key).

The server joins the store (``FLEXPIPE_DATABASE_URL``, else SQLite under ``FLEXPIPE_HOME``) as a
serving run (``--run-key``): its 2-s metric samples go there, ``gear_shift_sensor`` decides on them,
and the shifts ``gear_shift`` runs request for it are applied live (warm-up, drain, switch, rollback)
while clients keep streaming; with ``--inline-control`` the server decides its shifts itself, with the
same controller, and needs no Dagster daemon. ``--gear latency`` (or ``balanced``, ``throughput``, or a
stored gear's id) starts on a gear of the newest stored plan, the plan's other gears being where a shift
may go. ``--no-store`` serves one gear stand-alone. ``--instances N`` serves N instances of the gear behind
the one router; ``--max-instances M`` scales them between 1 and M with the fleet scaler (the gear needs its
measured envelope, ``rps_max``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from flexpipe_dag.cli.chunked_prefill import (
    add_chunked_prefill_argument,
    chunked_prefill_tokens,
    chunked_runtime_options,
)
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.gear_builders import even_gear, load_gear
from flexpipe_dag.core.settings import check_number


def register(subparsers) -> None:
    from flexpipe_dag.control.fleet_scaler import FleetScalerConfig

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API (completions, chat, streaming, "
                                            "metrics) over a live pipeline")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gear", help="a gear JSON file (flexpipe_dag.core.gear.Gear), or a stored gear of the newest "
                                    "plan by kind (latency, balanced, throughput) or id")
    src.add_argument("--stages", type=int, help="even split of the model's layers into N stages")
    src.add_argument("--plan", action="store_true",
                     help="the gear the newest stored plan recommends: for --load-rps, the one on the fewest devices "
                          "that holds it (as `flexpipe plan --load-rps`), else its latency gear")
    p.add_argument("--load-rps", type=float, default=None,
                   help="with --plan: the expected load, req/s, the recommended gear is chosen for")
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the id clients send as `model` (default: the checkpoint's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (another than loopback needs --api-key-file)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one, printed at startup)")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="file holding the API key clients must send (Authorization: Bearer KEY)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="with --stages")
    p.add_argument("--inflight", type=int, default=None, help="max in-flight micro-batches (default: stages)")
    add_chunked_prefill_argument(p)
    p.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV pool per lane, tokens (default 8192 with --stages; a gear file's own, or less)")
    p.add_argument("--max-pending", type=int, default=256, help="open requests above which new ones get 429")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of a chat (or a chat batch line) that sets none (default: one KV lane's tokens / "
                        "the gear's micro-batch size, so a micro-batch of them fits; a request's KV is reserved whole at "
                        "admission); a completion's default stays OpenAI's 16")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGINT / SIGTERM, how long open requests may finish")
    p.add_argument("--run-key", default=None,
                   help="this server's serving-run key in the store (default: frontdoor-HOST-PID)")
    p.add_argument("--no-store", action="store_true",
                   help="serve stand-alone: no samples stored, no shifts, no Files / Batch API")
    p.add_argument("--inline-control", action="store_true",
                   help="decide gear shifts here with the controller (no Dagster daemon); default: apply the shifts "
                        "gear_shift runs request")
    p.add_argument("--dwell-s", type=float, default=None,
                   help="controller dwell after a shift, seconds (default: FLEXPIPE_DWELL_S, else the control file's "
                        "or the seed's 600 s)")
    p.add_argument("--instances", type=int, default=1,
                   help="pipeline instances of the gear started on this host behind the one router (each warmed up "
                        "and verified before requests reach it; default 1)")
    p.add_argument("--max-instances", type=int, default=None,
                   help="scale between 1 and this many instances (>= --instances) on the request rate, with the fleet "
                        "scaler; needs the gear's measured envelope (rps_max, from `flexpipe plan`)")
    p.add_argument("--scale-interval-s", type=float, default=None,
                   help="with --max-instances: seconds between two fleet scaler samples (default 2)")
    scaler = FleetScalerConfig()
    p.add_argument("--scale-dwell-s", type=float, default=None,
                   help=f"with --max-instances: seconds after a change before instances are given back (default "
                        f"{scaler.dwell_s:g}; scale-in also needs it above the "
                        f"{scaler.scale_in_cost_s:g} s an instance's warm-up + drain are "
                        "counted to cost)")
    p.add_argument("--scale-outage-hold-s", type=float, default=None,
                   help=f"with --max-instances: when the rate falls under {100 * scaler.outage_fraction:g}%% of the "
                        f"instances' envelope at once (an outage, not a tide), seconds the instances are held for "
                        f"its return before any is given back (default {scaler.outage_hold_s:g}; 0: no hold)")
    p.add_argument("--batch-inflight", type=int, default=8, help="Batch API lines on the pipeline at once")
    p.add_argument("--batch-pause-above", type=int, default=8,
                   help="open online requests above which no Batch API line is submitted")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="auto",
                   help="fp32, bf16, fp16 or auto (default: fp32 on CPU; bf16 on a GPU that has it, else fp16)")
    p.add_argument("--step-timeout-s", type=float, default=120.0)
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="Ray places the stage workers of every gear served (the first and each gear shift's new "
                        "one) on the hosts its devices belong to (--cluster), in the Ray cluster at ADDRESS "
                        "(deploy/MULTIHOST.md)")
    p.add_argument("--cluster", type=Path, default=None,
                   help="with --ray: the cluster profile saying which host (node_id) holds each device")
    p.add_argument("--ray-node-ip", default=None, metavar="IP",
                   help="with --ray: this host's address in the Ray cluster (the control stores bind it)")
    p.set_defaults(func=serve)


#: Largest ``--api-key-file``, bytes (a key is a line; the file is not a place for anything else).
API_KEY_FILE_MAX_BYTES = 4096


def read_api_key(path: Path | None) -> str | None:
    """The key in ``path`` (its first line, stripped), or None without a file.

    Raises:
        InputError: the file cannot be read or holds no key.
    """
    from flexpipe_dag.core.user_files import read_user_text

    if path is None:
        return None
    try:  # the capped reader: a FIFO, a device or a huge file is refused at once
        text = read_user_text(path, API_KEY_FILE_MAX_BYTES, what="API key").strip()
    except InputError as exc:
        raise InputError(exc.source, "--api-key-file", exc.problem) from None
    key = text.splitlines()[0].strip() if text else ""
    if not key:
        raise InputError(str(path), None, "expected the API key on its first line; the file is empty")
    return key


def newest_plan_gears(store, flag: str, problem: str) -> tuple[Gear, ...]:
    """The gears of the newest stored plan (those of the newest cluster profile).

    Raises:
        InputError: none is stored; ``flag`` and ``problem`` say which option needed them, then how to plan.
    """
    latest = store.latest_profile()
    gears = tuple(store.load_gears(latest[0].id)) if latest is not None else ()
    if not gears:
        raise InputError(None, flag, f"{problem} (run `flexpipe demo`, or the plan_gears job, first)")
    return gears


def stored_gears(store, wanted: str) -> tuple:
    """(the gear ``wanted`` names, every gear of the newest plan): ``wanted`` is a kind or a gear id.

    Raises:
        InputError: no plan is stored, or no gear of it has that kind or id (the ones there are listed).
    """
    gears = newest_plan_gears(store, "--gear", f"{wanted!r} is not a file, and the store holds no planned gears to "
                                               "look it up in")
    match = [g for g in gears if g.gear_id == wanted] or [g for g in gears if g.kind == wanted]
    if not match:
        known = ", ".join(f"{g.gear_id} ({g.kind})" for g in gears)
        raise InputError(None, "--gear", f"expected a gear file, a kind or a stored gear id; {wanted!r} is none "
                                         f"of those (stored: {known})")
    return match[0], tuple(gears)


def planned_gear(store, load_rps: float | None) -> tuple[Gear, tuple[Gear, ...], str]:
    """(the gear to start on, every gear of the newest plan, why that one) for ``flexpipe serve --plan``.

    With ``load_rps``, the gear :func:`~flexpipe_dag.planner.operating.recommend_gear` picks (the fewest
    devices whose measured envelope holds the load, 20 % headroom preferred; with none, the largest
    envelope, and the reason says the load exceeds every one); without, the plan's latency gear (the
    lowest TPOT at low load; the shift controller moves up from there as the load rises).

    Raises:
        InputError: no plan is stored, or ``load_rps`` is not a finite rate >= 0.
    """
    from flexpipe_dag.planner.operating import recommend_gear

    gears = newest_plan_gears(store, "--plan", "the store holds no planned gears")
    if load_rps is None:
        gear = next((g for g in gears if g.kind == "latency"), gears[0])
        return gear, gears, f"{gear.gear_id} is the plan's {gear.kind} gear (no --load-rps given)"
    rec = recommend_gear(gears, load_rps)
    return next(g for g in gears if g.gear_id == rec.gear_id), gears, rec.reason


def _store_link(args: argparse.Namespace):
    """The store this server registers in, under ``--run-key`` (checked before any model loads)."""
    import os
    import re
    import socket

    from flexpipe_dag.control.settings import resolve_control_settings
    from flexpipe_dag.core.ids import check_id
    from flexpipe_dag.core.settings import env_value
    from flexpipe_dag.serving.frontdoor.server import StoreLink
    from flexpipe_dag.sql.store import Store

    default = "frontdoor-" + re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40] + f"-{os.getpid()}"
    run_key = check_id(args.run_key or default, None, "--run-key")
    dwell_s = args.dwell_s if args.dwell_s is not None else env_value("FLEXPIPE_DWELL_S", float, None, ge=0,
                                                                      unit="seconds")
    if dwell_s is not None and dwell_s < 0:
        raise InputError(None, "--dwell-s", f"expected >= 0, got {dwell_s}")
    control = resolve_control_settings(os.environ.get("FLEXPIPE_CONTROL_FILE", ""), dwell_s=dwell_s)
    return StoreLink(store=Store.from_url(), control=control, run_key=run_key, batch_inflight=args.batch_inflight,
                     batch_pause_above=args.batch_pause_above, inline_control=args.inline_control)


def instance_settings(args: argparse.Namespace):
    """The :class:`~flexpipe_dag.serving.frontdoor.server.InstanceSettings` of ``--instances``,
    ``--max-instances``, ``--scale-interval-s``, ``--scale-dwell-s`` and ``--scale-outage-hold-s`` (checked,
    before any model loads;
    the gear's envelope is checked once the gear is known).

    Raises:
        InputError: naming the flag.
    """
    from flexpipe_dag.control.fleet_scaler import MAX_DWELL_S, MAX_OUTAGE_HOLD_S, FleetScalerConfig
    from flexpipe_dag.serving.frontdoor.server import SCALE_INTERVAL_S, InstanceSettings

    for flag, value in (("--scale-interval-s", args.scale_interval_s), ("--scale-dwell-s", args.scale_dwell_s),
                        ("--scale-outage-hold-s", args.scale_outage_hold_s)):
        if value is not None and args.max_instances is None:
            raise InputError(None, flag, "only means something with --max-instances")
    interval_s = SCALE_INTERVAL_S if args.scale_interval_s is None else args.scale_interval_s
    check_number(interval_s, None, "--scale-interval-s", gt=0, le=3600, unit="s")
    figures = {"sample_period_s": interval_s}
    if args.scale_dwell_s is not None:
        check_number(args.scale_dwell_s, None, "--scale-dwell-s", ge=0, le=MAX_DWELL_S, unit="s")
        figures["dwell_s"] = args.scale_dwell_s
    if args.scale_outage_hold_s is not None:
        check_number(args.scale_outage_hold_s, None, "--scale-outage-hold-s", ge=0, le=MAX_OUTAGE_HOLD_S, unit="s")
        figures["outage_hold_s"] = args.scale_outage_hold_s
    settings = InstanceSettings(instances=args.instances, max_instances=args.max_instances,
                                scaler=FleetScalerConfig.model_validate(figures))
    settings.check()
    return settings


def serve(args: argparse.Namespace) -> int:
    from flexpipe_dag.cli.run import check_cuda, check_gear_shape_flags, ray_placement
    from flexpipe_dag.planner.fleet import no_envelope_problem
    from flexpipe_dag.runtime.model_loader import head_dtype, resolve_checkpoint
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from flexpipe_dag.serving.frontdoor.server import FrontDoorServer, ServerSettings, check_several

    check_gear_shape_flags(args)
    for name in ("max_pending", "batch_inflight", "kv_capacity_tokens", "default_max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InputError(None, "--" + name.replace("_", "-"), f"expected >= 1, got {getattr(args, name)}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise InputError(None, "--served-model-name", "expected a name clients send as 'model'; got an empty one")
    if args.load_rps is not None:
        check_number(args.load_rps, None, "--load-rps", ge=0, unit="req/s")
    if args.no_store and args.run_key:
        raise InputError(None, "--run-key", "names this server's run in the store: drop --no-store, or the key")
    check_number(args.drain_timeout_s, None, "--drain-timeout-s", ge=0, le=86400, unit="s")
    chunked_prefill_tokens(args)
    instances = instance_settings(args)
    check_several(instances, inline_control=args.inline_control and not args.no_store, ray=args.ray is not None)
    placement = ray_placement(args)
    if args.device == "cuda":
        check_cuda(remote=placement is not None)  # without Ray, serve runs its stages on this host
    try:
        args.dtype = head_dtype(args.dtype, args.device)
    except InputError as exc:
        raise InputError(None, "--dtype", exc.problem) from None
    settings = ServerSettings(host=args.host, port=args.port, api_key=read_api_key(args.api_key_file),
                              model_name="", max_pending=args.max_pending, drain_timeout_s=args.drain_timeout_s,
                              default_max_tokens=args.default_max_tokens or 0)
    settings.check()  # before a model loads
    if args.inline_control and args.no_store:
        raise InputError(None, "--inline-control", "shifts need the store: drop --no-store")
    if args.load_rps is not None and not args.plan:
        raise InputError(None, "--load-rps", "only means something with --plan")
    if args.plan and args.no_store:
        raise InputError(None, "--plan", "the plan is read from the store: drop --no-store")
    if instances.max_instances is not None and not (args.gear or args.plan):
        # the --stages gear is never measured: refuse before the checkpoint is read (a GGUF is converted)
        raise InputError(None, "--max-instances", f"gear uniform-{args.stages}: {no_envelope_problem(None)}")
    link = None if args.no_store else _store_link(args)
    ckpt = resolve_checkpoint(args.model)
    candidates: tuple[Gear, ...] = ()
    if args.gear or args.plan:
        if args.plan and link is not None:  # --plan without the store was refused above
            gear, candidates, why = planned_gear(link.store, args.load_rps)
            print(f"flexpipe serve --plan: {why}", file=sys.stderr, flush=True)
        elif Path(args.gear).exists() or link is None:
            gear = load_gear(Path(args.gear))
        else:
            gear, candidates = stored_gears(link.store, args.gear)
        if args.kv_capacity_tokens:
            gear = gear.with_kv_pool_capped(args.kv_capacity_tokens)
            candidates = tuple(g.with_kv_pool_capped(args.kv_capacity_tokens) for g in candidates)
        if link is not None:
            link = dataclasses.replace(link, gears=candidates)
    else:
        gear = even_gear(ckpt.num_layers, args.stages, ckpt.name, args.micro_batch_size, args.inflight,
                         args.kv_capacity_tokens or 8192)
    instances.check(gear)  # --max-instances needs the gear's envelope
    settings = ServerSettings(**{**settings.__dict__, "model_name": args.served_model_name or ckpt.name})
    runtime = PipelineRuntime(gear, ckpt, RuntimeOptions(**chunked_runtime_options(args), dtype=args.dtype, device=args.device,
                                                         step_timeout_s=args.step_timeout_s, stream_tokens=True,
                                                         kv_capacity_knob="--kv-capacity-tokens", placement=placement))
    server = FrontDoorServer(runtime, ckpt.tokenizer(), ckpt.eos_token_ids(), runtime.max_context_tokens, settings,
                             link=link, instances=instances)
    count = f"{args.instances} instance(s)" + (f", up to {args.max_instances}" if args.max_instances else "")
    print(f"flexpipe serve: model {settings.model_name!r}, gear {gear.gear_id} ({gear.num_stages} stage(s), {count}); "
          f"starting the pipeline, then http://{args.host}:{args.port or 'PORT'}/v1"
          + (" (a free port: uvicorn's startup line below names it)" if not args.port else ""),
          file=sys.stderr, flush=True)
    return server.run()
