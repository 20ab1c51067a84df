"""``flexpipe run``: serve a prompts file (or a trace slice) through a gear's pipeline into a results file.

A request whose prompt + ``max_new_tokens`` exceed the model's max context
(``max_position_embeddings``) is refused with its reason, and the run exits 1; with
``--truncate-context`` it is served with the prompt cut from the left (the latest tokens kept).
Either way the summary counts them (``refused_context`` / ``truncated_context``).

Plain-text prompts go in the model's chat template when it has one (``--chat-template auto``, the
default; see :mod:`flexpipe_dag.runtime.chat_template`). Results whose output decodes to no text (an
end-of-sequence token at once) are named in a warning and counted in the summary (``no_text``).

``--score`` runs a prefill-only scoring job instead (log-prob of each prompt, or of each row's
``continuations`` with the best one as ``choice``) on DeepSpeed's PipelineModule, partitioned
exactly at the gear's stage boundaries.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexpipe_dag.cli.chunked_prefill import (
    add_chunked_prefill_argument,
    chunked_prefill_tokens,
    chunked_runtime_options,
)
from flexpipe_dag.core.errors import FlexPipeError, InputError
from flexpipe_dag.core.gear_builders import even_gear, inflight_to_fill, load_gear
from flexpipe_dag.runtime.chat_template import CHAT_TEMPLATE_MODES, PromptFormat, resolve_chat_template


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run a batch of prompts through a pipeline gear (one process per stage)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gear", type=Path, help="gear JSON file (flexpipe_dag.core.gear.Gear)")
    src.add_argument("--stages", type=int, help="N stages of one worker each on this host (--split says how the "
                                                "model's layers are split over them)")
    inp = p.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompts", type=Path, help="JSONL or Parquet: id, prompt | token_ids, max_new_tokens, priority")
    inp.add_argument("--trace", type=Path, help="Azure LLM trace CSV (ContextTokens, GeneratedTokens): prompt "
                                                "lengths taken from it, text from the bundled corpus")
    p.add_argument("--num-requests", type=int, default=64, help="trace rows to use (with --trace)")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="cap on trace prompt lengths")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="with --trace: multiply the trace's prompt / output lengths by this before capping")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="new tokens per request: a row without max_new_tokens gets this, a row asking for more "
                        "gets this (the cap)")
    p.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default="auto",
                   help="plain-text prompts and a chat model: auto wraps each in the tokenizer's chat template when "
                        "it has one; on: the same, refusing a model without one; off: as they are (a warning for a "
                        "chat model). Generation only: --score scores prompts as they are")
    p.add_argument("--truncate-context", action="store_true",
                   help="serve a request whose prompt + max_new_tokens exceed the model's max context with the prompt "
                        "cut from the left (default: refuse it); only the prompt is cut: a request whose "
                        "max_new_tokens alone fill the context is still refused")
    p.add_argument("--out", type=Path, default=Path("results.jsonl"), help="results JSONL (re-runs skip done ids)")
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="with --stages")
    p.add_argument("--inflight", type=int, default=None,
                   help="max in-flight micro-batches (default: enough to keep every stage worker busy, "
                        "max(ceil(prompts / micro-batch), stage workers), the planner's rule; with --score: stages)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV pool per stage in tokens (default 8192 with --stages; with --gear: cap the gear's pool, "
                        "e.g. a GPU-planned gear on a CPU host)")
    p.add_argument("--split", choices=("workload", "even"), default=None,
                   help="with --stages: workload (default): the layers split so the slowest stage is fastest for "
                        "these prompts, priced with the cost model on one worker measured here (the last stage's LM "
                        "head weighs per sampled token, a layer per token); even: layer counts differing by at most "
                        "one. Stages on other hosts (--listen, --launched, --ray) and --score split evenly")
    p.add_argument("--stage-replicas", default=None, metavar="R0,R1,...",
                   help="with --stages: replicas per stage (one worker each), e.g. 1,2 for a doubled last stage")
    add_chunked_prefill_argument(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="auto",
                   help="fp32, bf16, fp16 or auto (default: fp32 on CPU; bf16 on a GPU that has it, else fp16)")
    p.add_argument("--step-timeout-s", type=float, default=120.0)
    p.add_argument("--score", action="store_true",
                   help="prefill-only scoring on DeepSpeed's PipelineModule: per-row log-prob of the prompt, or of "
                        "each of the row's 'continuations' (then 'choice' = the most likely one)")
    p.add_argument("--no-token-logprobs", action="store_true", help="with --score: store sums only")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("--listen", default=None, metavar="HOST:PORT",
                       help="stage workers run elsewhere: serve the control store on PORT and wait for "
                            "`flexpipe worker --head HOST:PORT --stage S` on each stage's host (PORT 0: a free "
                            "port, printed in the 'waiting for ... stage workers at HOST:PORT' line)")
    hosts.add_argument("--launched", action="store_true",
                       help="started on every rank by DeepSpeed's launcher or torch.distributed.run (world size = "
                            "1 + one per stage replica): rank 0 is the head (scheduler, results), rank w+1 serves "
                            "worker slot w (stages in order, replicas together); the control store listens on "
                            "MASTER_ADDR:MASTER_PORT+1 (or --control-port)")
    hosts.add_argument("--ray", default=None, metavar="ADDRESS",
                       help="Ray places and starts the stage workers: one actor per worker, on the host its device "
                            "belongs to (--cluster), in the Ray cluster at ADDRESS (its GCS, e.g. 10.0.0.1:6379); each "
                            "host's Ray node offers the resource flexpipe_host_<node_id> (deploy/MULTIHOST.md)")
    p.add_argument("--cluster", type=Path, default=None,
                   help="with --ray: the cluster profile (YAML/JSON) saying which host (node_id) holds each device")
    p.add_argument("--ray-node-ip", default=None, metavar="IP",
                   help="with --ray: this host's address in the Ray cluster; the head's control store binds it "
                        "(default: the address Ray reports)")
    p.add_argument("--control-port", type=int, default=None, help="with --launched: the head's control port")
    p.add_argument("--secret-file", type=Path, default=None,
                   help="with --listen / --launched: the run secret every worker must prove (with --listen: read "
                        "if the file exists, else written there 0600; default: FLEXPIPE_RUN_SECRET_FILE / "
                        "FLEXPIPE_RUN_SECRET, else a new temporary file the startup message names)")
    p.add_argument("--start-timeout-s", type=float, default=300.0,
                   help="how long to wait for every stage to load (with --listen / --launched: to join and load)")
    p.set_defaults(func=run)


def parse_replicas(text: str | None) -> list[int] | None:
    """``"1,2,1"`` -> ``[1, 2, 1]`` (``None`` stays ``None``).

    Raises:
        InputError: naming ``--stage-replicas`` when an item is not an integer.
    """
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(None, "--stage-replicas", f"expected comma-separated integers, e.g. 1,2; got {text!r}") from None


def ray_placement(args: argparse.Namespace):
    """``--ray ADDRESS --cluster PROFILE``: a :class:`~flexpipe_dag.runtime.ray_placement.RayPlacement`
    mapping every device of the profile to its host (``None`` without ``--ray``).

    Raises:
        InputError: ``--cluster`` / ``--ray-node-ip`` without ``--ray``, ``--ray`` without ``--cluster``, or a
            bad profile.
    """
    if args.ray is None:
        for flag, value in (("--cluster", args.cluster), ("--ray-node-ip", args.ray_node_ip)):
            if value is not None:
                raise InputError(None, flag, "only with --ray ADDRESS (stage workers placed by Ray)")
        return None
    if args.cluster is None:
        raise InputError(None, "--cluster", "with --ray: expected the cluster profile that says which host holds "
                                            "each device of the gear")
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.runtime.ray_placement import RayPlacement

    return RayPlacement.from_profile(load_cluster_profile(args.cluster), address=args.ray,
                                     node_ip_address=args.ray_node_ip)


def check_gear_shape_flags(args: argparse.Namespace) -> None:
    """``--micro-batch-size`` and ``--inflight`` (``run`` and ``serve``) within what a gear holds.

    Raises:
        InputError: naming the flag and the range (a gear's own limits, :mod:`flexpipe_dag.core.gear`).
    """
    from flexpipe_dag.core.gear import MAX_INFLIGHT_MICRO_BATCHES, MAX_MICRO_BATCH_SIZE

    for flag, value, top in (("--micro-batch-size", args.micro_batch_size, MAX_MICRO_BATCH_SIZE),
                             ("--inflight", args.inflight, MAX_INFLIGHT_MICRO_BATCHES)):
        if value is not None and not 1 <= value <= top:
            raise InputError(None, flag, f"expected an integer 1..{top}, got {value}")


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad numbers and an unusable ``--out`` before anything loads or launches.

    Raises:
        InputError: naming the flag and what was expected.
    """
    from flexpipe_dag.core.dtypes import compute_dtype
    from flexpipe_dag.core.settings import INT32_MAX
    from flexpipe_dag.runtime.model_loader import head_dtype

    for flag, value, low in (("--num-requests", args.num_requests, 1), ("--max-prompt-tokens", args.max_prompt_tokens, 1),
                             ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--kv-capacity-tokens", 1 if args.kv_capacity_tokens is None else args.kv_capacity_tokens, 1)):
        if not low <= value <= INT32_MAX:
            raise InputError(None, flag, f"expected an integer {low}..{INT32_MAX}, got {value}")
    check_gear_shape_flags(args)
    if args.gear and args.split:
        raise InputError(None, "--split", f"splits the layers of a --stages run; gear '{args.gear}' has its own stages")
    if chunked_prefill_tokens(args) is not None and args.score:
        raise InputError(None, "--chunked-prefill-tokens", "is for generation; --score runs each prompt whole through "
                                                           "DeepSpeed's pipeline")
    if not (args.start_timeout_s > 0 and math.isfinite(args.start_timeout_s)):
        raise InputError(None, "--start-timeout-s", f"expected a positive number of seconds, got {args.start_timeout_s}")
    if args.device == "cuda":
        check_cuda(remote=bool(args.listen or args.launched or args.ray))
    if not (args.step_timeout_s > 0 and math.isfinite(args.step_timeout_s)):
        raise InputError(None, "--step-timeout-s", f"expected a positive number of seconds, got {args.step_timeout_s}")
    if not (args.length_scale > 0 and math.isfinite(args.length_scale)):
        raise InputError(None, "--length-scale", f"expected a positive number, got {args.length_scale}")
    if args.dtype != "auto":  # int8 / int4 plan weights; the runtime does not compute in them
        args.dtype = compute_dtype(args.dtype, None, "--dtype").name
    args.dtype = head_dtype(args.dtype, args.device)
    from flexpipe_dag.core.user_files import check_output_file

    check_output_file(args.out, "--out", "a JSONL file path")


def check_cuda(remote: bool) -> None:
    """``--device cuda`` needs CUDA here, or, when the stages run elsewhere, a torch build with NCCL
    (the head joins the process group but takes no GPU).

    Raises:
        InputError: naming ``--device``.
    """
    import torch
    import torch.distributed as dist

    if remote and not dist.is_nccl_available():
        raise InputError(None, "--device", "cuda: this host's torch has no NCCL (a CPU build); the head of a "
                                           "CUDA pipeline needs a CUDA build of torch, even without a GPU")
    if not remote and not torch.cuda.is_available():
        raise InputError(None, "--device", "cuda: no CUDA device visible to torch on this host")


def resolve_trace(trace) -> Path:
    """A bundled trace name (``azure-conv``, ``azure-code``) or an existing file; InputError otherwise."""
    from flexpipe_dag.workload.bundled import bundled_path

    path = Path(trace)
    if path.is_file():
        return path
    try:
        return bundled_path(str(trace))
    except InputError:
        raise InputError(str(trace), "--trace", "no such file, and not a bundled trace name "
                         "(azure-conv, azure-code)") from None


def open_sink(path: Path):
    """The JSONL results sink, opened before any worker starts (a bad file fails fast, losing nothing).

    Opening only reads ``path``; a torn or unterminated last line is repaired at the first append,
    so a command refused for any other reason (prompts, gear, model) leaves ``--out`` as it was.

    Raises:
        InputError: naming ``--out`` (and the line) when the file is a link, not a regular file,
            unreadable, or not a results file (:func:`~flexpipe_dag.runtime.results_file.scan_results`).
    """
    from flexpipe_dag.runtime.results_file import JsonlSink

    try:  # a torn last line (a crash mid-write) is cut at the first append, and said so on stderr
        return JsonlSink(path, on_note=lambda note: print(f"flexpipe run: {note}", file=sys.stderr))
    except InputError as exc:
        where = f"{exc.field}: " if exc.field else ""
        raise InputError(str(path), "--out", f"cannot use it as the results file: {where}{exc.problem}") from None
    except OSError as exc:
        raise InputError(str(path), "--out", f"cannot use it as the results file: {exc.strerror or exc}") from None


def launched_head(args: argparse.Namespace) -> tuple[int, int, str]:
    """Under a launcher: ``(rank, world_size, "MASTER_ADDR:control port")`` from its variables.

    Raises:
        InputError: a variable missing or not an integer, or a control port out of range.
    """
    from flexpipe_dag.core.settings import env_value

    rank, world = env_value("RANK", int), env_value("WORLD_SIZE", int)
    addr, port = os.environ.get("MASTER_ADDR"), env_value("MASTER_PORT", int)
    if rank is None or world is None or addr is None or port is None:
        name = next(name for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", addr),
                                             ("MASTER_PORT", port)) if value is None)
        raise InputError(None, name, "--launched expects the launcher's RANK, WORLD_SIZE, MASTER_ADDR and "
                                     "MASTER_PORT (run it under deepspeed or torch.distributed.run)")
    control = args.control_port if args.control_port is not None else port + 1
    if not 1 <= control <= 65535:
        raise InputError(None, "--control-port", f"expected a TCP port 1..65535, got {control}")
    return rank, world, f"{addr}:{control}"


def launched_secret(args: argparse.Namespace) -> str:
    """The run secret of a launched rank (``--secret-file``, else the environment the launcher forwards).

    Raises:
        InputError: none given, or the file / variable holds no valid secret.
    """
    from flexpipe_dag.runtime.control_auth import SECRET_ENV, SECRET_FILE_ENV, resolve_secret

    secret = resolve_secret(args.secret_file)
    if secret is None:
        raise InputError(None, "--secret-file", f"--launched needs the run secret on every rank: --secret-file "
                                                f"FILE, or {SECRET_FILE_ENV} / {SECRET_ENV} in the environment "
                                                f"the launcher forwards")
    return secret


def run(args: argparse.Namespace) -> int:
    """``flexpipe run``; returns the exit status. On the head, SIGINT / SIGTERM stop the run: what
    finished is in ``--out``, every child process is ended, and the last stderr line says so
    (:func:`stop_line`); the status is then ``128 + signal`` (130, 143)."""
    from flexpipe_dag.runtime.stop import RunStopped, StopSignals

    if args.launched:
        rank, world, control_address = launched_head(args)
        if rank > 0:  # a stage rank: everything else comes from the head
            from flexpipe_dag.core.settings import env_value
            from flexpipe_dag.runtime.remote import serve_stage

            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            return serve_stage(control_address, worker=rank - 1, model=args.model, device=args.device,
                               local_rank=env_value("LOCAL_RANK", int, 0), secret=launched_secret(args))
    state = HeadState()
    with StopSignals() as stop:
        try:
            code = _run_head(args, stop, state)
        except (FlexPipeError, RunStopped):
            if not stop.stopped:
                raise
            code = stop.exit_status
    if stop.stopped:
        print(stop_line(stop.reason, args.out, state, remote=bool(args.listen)), file=sys.stderr)
        return stop.exit_status
    return code


@dataclass
class HeadState:
    """What the head got to, for the stop line: the results sink once open, the request ids once
    read, and how many finished in this run."""

    sink: Any = None
    request_ids: set[str] | None = None
    finished: int = 0


def stop_line(reason: str, out: Path, state: HeadState, remote: bool = False) -> str:
    """The one line a stopped run ends with, e.g. ``flexpipe run: stopped by SIGTERM after 41 of 120
    requests (12 in this run); 41 results in out.jsonl; re-run the same command to resume``
    (``remote``: a ``--listen`` head, whose workers must be started again too)."""
    again = "re-run the same command" + (" and start its workers again" if remote else "")
    if state.sink is None or state.request_ids is None:
        return f"flexpipe run: {reason} before serving any request; {out} unchanged; {again} to start"
    total = len(state.request_ids)
    done = len(state.sink.done_ids() & state.request_ids)
    tail = f"{again} to resume" if done < total else "every request is done"
    where = f"{done} results in {out}" if done or Path(out).exists() else f"no results yet ({out} not created)"
    return f"flexpipe run: {reason} after {done} of {total} requests ({state.finished} in this run); {where}; {tail}"


def _run_head(args: argparse.Namespace, stop, state: HeadState) -> int:
    """The head of a run (everything but a launched stage rank), with ``stop`` routing stop signals."""

    from flexpipe_dag.runtime.batch import out_of_vocabulary, prompts_from_trace, read_prompts
    from flexpipe_dag.runtime.control_auth import HeadSecret
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions

    control_address = args.listen
    secret, head_secret = None, None
    if args.control_port is not None and not args.launched:
        raise InputError(None, "--control-port", "only with --launched (with --listen the port is part of HOST:PORT)")
    if args.secret_file is not None and not (args.launched or args.listen):
        raise InputError(None, "--secret-file", "only with --listen or --launched (a one-host run makes its own)")
    placement = ray_placement(args)
    if args.launched:
        _rank, world, control_address = launched_head(args)
        secret = launched_secret(args)
    elif control_address is not None:
        from flexpipe_dag.runtime.rendezvous import parse_listen_address

        parse_listen_address(control_address, "--listen")
    if args.score and (control_address or placement is not None):
        raise InputError(None, "--score", "scoring across hosts runs under the launcher as "
                                          "`python -m flexpipe_dag.runtime.score_launch` (deploy/MULTIHOST.md)")
    check_args(args)
    if args.trace is not None:
        args.trace = resolve_trace(args.trace)
    sink = state.sink = open_sink(args.out)
    ckpt = resolve_checkpoint(args.model)
    if args.gear:
        if args.stage_replicas:
            raise InputError(None, "--stage-replicas", "only with --stages (a gear file carries its replicas)")
        gear = load_gear(args.gear)
        if args.kv_capacity_tokens:
            gear = gear.with_kv_pool_capped(args.kv_capacity_tokens)
    else:
        gear = even_gear(ckpt.num_layers, args.stages, ckpt.name, args.micro_batch_size, args.inflight,
                         args.kv_capacity_tokens or 8192, parse_replicas(args.stage_replicas))
    if args.prompts:
        rows, malformed = read_prompts(args.prompts, args.max_new_tokens)
    elif args.trace is not None:
        rows, malformed = prompts_from_trace(args.trace, ckpt.tokenizer(), num_requests=args.num_requests,
                                             max_prompt_tokens=args.max_prompt_tokens,
                                             max_new_tokens=args.max_new_tokens,
                                             length_scale=args.length_scale), []
    else:  # the parser requires one of the two
        raise InputError(None, "--prompts", "expected --prompts FILE or --trace FILE|NAME")
    rows, out_of_vocab = out_of_vocabulary(rows, len(ckpt.tokenizer()))
    malformed = sorted([*malformed, *out_of_vocab], key=lambda m: m.line)
    state.request_ids = {r.request_id for r in rows}
    if not rows:
        for m in malformed[:20]:
            print(f"malformed row {m.line}: {m.reason}", file=sys.stderr)
        why = (f"{len(malformed)} malformed row(s), listed above" if malformed
               else "the file holds no rows; expected one JSON object per line")
        raise InputError(str(args.prompts or args.trace), None, f"no valid request ({why})")
    prompt_format = resolve_chat_template(args.chat_template, ckpt.tokenizer(), ckpt.name,
                                          [r.prompt if r.token_ids is None else None for r in rows],
                                          source="--chat-template")
    if args.score:
        from flexpipe_dag.runtime.pipeline import check_gear_supported

        check_gear_supported(gear)  # before any banner: scoring has one rank per stage
        return _score(args, gear, ckpt, rows, malformed, sink, state)
    if not args.gear and (args.split or "workload") == "workload" and args.stages > 1 and not control_address and placement is None:
        gear = _split_for_rows(args, ckpt, gear, rows, sink.done_ids(), prompt_format)
    workers = sum(st.replicas for st in gear.stages)
    if not args.gear and args.inflight is None:  # an offline run: every stage worker kept busy
        gear = gear.model_copy(update={"max_inflight_micro_batches": inflight_to_fill(workers, len(rows),
                                                                                       gear.micro_batch_size)})
    if args.launched and world != workers + 1:
        raise InputError(None, "WORLD_SIZE", f"gear {gear.gear_id!r} has {workers} stage workers (a replica each): "
                                             f"launch {workers + 1} ranks (head + one per worker), got {world}")
    if args.listen:  # the file is written once the port is bound, and a generated one removed at the end
        head_secret = HeadSecret.resolve(args.secret_file)
        secret = head_secret.secret
    options = RuntimeOptions(**chunked_runtime_options(args),
                             dtype=args.dtype, device=args.device, step_timeout_s=args.step_timeout_s,
                             control_address=control_address, start_timeout_s=args.start_timeout_s,
                             truncate_context=args.truncate_context, secret=secret, placement=placement,
                             kv_capacity_knob="--kv-capacity-tokens" + (" (up to the gear's kv_capacity_tokens)"
                                                                        if args.gear else ""))
    runtime = PipelineRuntime(gear, ckpt, options)
    if not control_address and placement is None and {r.request_id for r in rows} <= sink.done_ids():
        return _nothing_to_run(args, runtime, rows, malformed)  # remote workers, if any, wait for this head
    try:
        return _serve_run(args, runtime, gear, ckpt, rows, malformed, sink, state, stop, control_address, head_secret,
                          prompt_format)
    finally:
        if head_secret is not None:
            head_secret.discard()


def _serve_run(args: argparse.Namespace, runtime, gear, ckpt, rows, malformed, sink, state: HeadState, stop,
               control_address: str | None, head_secret, prompt_format: PromptFormat) -> int:
    """Serve ``rows`` on ``runtime`` (the control port bound first, then ``head_secret`` published), their
    text prompts as ``prompt_format`` says."""
    from tqdm import tqdm

    from flexpipe_dag.runtime.batch import no_text_line, run_batch_job
    from flexpipe_dag.runtime.control_auth import SECRET_ENV

    workers = sum(st.replicas for st in gear.stages)
    # SIGINT / SIGTERM (a launcher stops every rank with SIGTERM when one exits) end the run at the
    # watchdog's next tick: results finished by then are kept, a remote stage that went silent is named
    stop.attach(runtime)
    if not control_address and args.device == "cpu" and workers > (os.cpu_count() or 1):
        print(f"warning: {workers} stage workers on {os.cpu_count()} CPU cores: they will compete for the cores",
              file=sys.stderr)
    where = (f"waiting for {workers} stage workers at {runtime.listen()}" if control_address  # the bound port
             else f"placing {workers} stage workers with Ray (cluster at {args.ray})" if args.ray
             else "starting workers")
    if head_secret is not None:
        secret_path = head_secret.publish()  # after the bind: a refused address leaves no file behind
        where += (f" (run secret in {secret_path}: give each worker a copy, mode 0600, with --secret-file)"
                  if secret_path else f" (run secret from ${SECRET_ENV})")
    if prompt_format.message:
        print(("warning: " if prompt_format.warn else "") + prompt_format.message, file=sys.stderr)
    print(f"gear {gear.gear_id}: stages {gear.layer_ranges()}, micro-batch {gear.micro_batch_size}, "
          f"{gear.max_inflight_micro_batches} in flight; {where}...", file=sys.stderr)
    with runtime:
        for info in runtime.stage_info:
            replica = f" replica {info['replica_index']}" if gear.stages[info["stage_index"]].replicas > 1 else ""
            print(f"  stage {info['stage_index']}{replica} layers [{info['layer_start']}, {info['layer_end']}): "
                  f"weights {info['param_bytes'] / 2**20:.1f} MiB, KV pool {info['kv_pool_bytes'] / 2**20:.1f} MiB "
                  f"({info['kv_capacity_tokens']} tokens), pid {info['pid']} on {info.get('host', '?')}",
                  file=sys.stderr)
        bar = tqdm(total=len(rows), unit="req", desc="flexpipe run")
        bar.update(len(sink.done_ids() & {r.request_id for r in rows}))

        def progress(done: int, total: int) -> None:
            state.finished = done
            bar.update(1)

        report = run_batch_job(runtime, rows, sink, malformed=malformed, on_progress=progress,
                               chat_template=prompt_format.apply)
        bar.close()
    stop.detach()
    empty = no_text_line(report.no_text, report.finished, ckpt.eos_token_ids(),
                         hint="--chat-template auto wraps plain prompts in the model's chat template"
                         if prompt_format.warn else None)
    if empty:
        print(f"warning: {empty}", file=sys.stderr)
    summary = _run_summary(report, args, runtime)
    for request_id, why in list(report.refused.items())[:20]:
        print(f"refused {request_id}: {why}", file=sys.stderr)
    if report.over_context:
        if not report.refused_context:
            done = "served with the prompt truncated from the left"
        elif args.truncate_context:
            done = (f"{len(report.truncated)} served with the prompt truncated from the left, "
                    f"{report.refused_context} refused: max_new_tokens alone leaves no room for the prompt")
        else:
            done = "refused (--truncate-context serves them truncated)"
        print(f"context: {report.over_context} of {report.submitted} requests over {ckpt.name}'s "
              f"{runtime.max_context_tokens}-token max context (prompt + max_new_tokens): {done}", file=sys.stderr)
    return _report(summary, report.malformed)


def _split_for_rows(args: argparse.Namespace, ckpt, gear, rows, done: set[str], prompt_format: PromptFormat):
    """``gear`` (an even ``--stages`` gear) with its layers split for the rows still to run
    (:func:`~flexpipe_dag.profiling.worker_split.split_gear_for_rows`); the split is printed (stderr)."""
    from flexpipe_dag.profiling.worker_split import split_gear_for_rows
    from flexpipe_dag.runtime.model_loader import resolve_dtype

    device = "cuda:0" if args.device == "cuda" else "cpu"
    gear, split = split_gear_for_rows(gear, ckpt, rows, done, prompt_format.apply, device,
                                      resolve_dtype(args.dtype, device), args.truncate_context)
    if split is not None:
        print(split.describe(), file=sys.stderr)
    return gear


def _run_summary(report, args: argparse.Namespace, runtime) -> dict:
    """The JSON summary line of a generation run (``report``: its
    :class:`~flexpipe_dag.runtime.batch.BatchReport`)."""
    return {"rows": report.rows, "finished": report.finished, "skipped_done": report.skipped_done,
            "malformed": len(report.malformed), "refused": len(report.refused),
            "output_tokens": report.output_tokens, "elapsed_s": round(report.elapsed_s, 2),
            "output_tokens_per_s": round(report.output_tokens_per_s, 2), "out": str(args.out),
            "failure": report.failure, "max_context_tokens": runtime.max_context_tokens,
            "over_context": report.over_context, "refused_context": report.refused_context,
            "truncated_context": len(report.truncated), "no_text": len(report.no_text)}


def _nothing_to_run(args: argparse.Namespace, runtime, rows, malformed) -> int:
    """A re-run whose every row already has a result in ``--out``: say so and print the summary, no stage worker
    started (starting them costs seconds to minutes: the model load, a remote placement)."""
    from flexpipe_dag.runtime.batch import BatchReport

    print(f"flexpipe run: all {len(rows)} requests already have results in {args.out}: nothing to run, "
          "no stage worker started", file=sys.stderr)
    report = BatchReport(rows=len(rows), malformed=malformed, skipped_done=len(rows), submitted=0, finished=0)
    return _report(_run_summary(report, args, runtime), malformed)


def _report(summary: dict, malformed) -> int:
    """Print the malformed rows (stderr) and the JSON summary; exit status 1 when the run broke off or
    requests were refused (they can never fit this gear's KV pool: nothing a re-run would fix)."""
    for m in malformed[:20]:
        print(f"malformed row {m.line}: {m.reason}", file=sys.stderr)
    print(json.dumps(summary))
    return 1 if summary["failure"] or summary.get("refused") else 0


def _score(args: argparse.Namespace, gear, ckpt, rows, malformed, sink, state: HeadState) -> int:
    from tqdm import tqdm

    from flexpipe_dag.runtime.score_runtime import ScoreOptions, run_score_job

    options = ScoreOptions(micro_batch_size=gear.micro_batch_size, max_micro_batches=gear.max_inflight_micro_batches,
                           dtype=args.dtype, device=args.device, step_timeout_s=max(args.step_timeout_s, 300.0),
                           keep_token_logprobs=not args.no_token_logprobs)
    print(f"gear {gear.gear_id}: scoring on DeepSpeed PipelineModule, stages {gear.layer_ranges()}, micro-batch "
          f"{gear.micro_batch_size} x {gear.max_inflight_micro_batches} per batch; starting ranks (the first run "
          f"on a host compiles DeepSpeed's shm op, about a minute)...", file=sys.stderr)
    bar = tqdm(total=len(rows), unit="row", desc="flexpipe run --score")
    bar.update(len(sink.done_ids() & {r.request_id for r in rows}))

    def progress(done: int, total: int) -> None:
        state.finished = done
        bar.update(1)

    report = run_score_job(gear, rows, sink, model=ckpt, options=options, malformed=malformed, on_progress=progress)
    bar.close()
    summary = {"rows": report.rows, "finished": report.finished, "skipped_done": report.skipped_done,
               "malformed": len(report.malformed), "units": report.units, "scored_tokens": report.scored_tokens,
               "start_s": round(report.start_s, 2), "elapsed_s": round(report.elapsed_s, 2),
               "forward_tokens_per_s": round(report.forward_tokens_per_s, 2), "out": str(args.out),
               "failure": report.failure}
    return _report(summary, report.malformed)
