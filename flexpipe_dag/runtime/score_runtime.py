"""Prefill-only scoring jobs on DeepSpeed's pipeline engine, split exactly as a gear says.

Each gear stage is one DeepSpeed rank holding a :func:`~flexpipe_dag.runtime.pipe_layers.gear_pipeline_module`
partition; batches from :func:`~flexpipe_dag.runtime.scoring.plan_score_batches` run through
``PipelineEngine.eval_batch`` (DeepSpeed's ``InferenceSchedule``: micro-batches of one batch overlap
across stages). The last stage turns logits into next-token log-probs (the module's ``loss_fn``)
and hands back each unit's scored tokens.

Two ways to start the ranks, one rank body (:func:`run_score_rank`):

* :func:`run_score_job` (``flexpipe run --score``): this host, one process per stage,
  results written to a sink as rows complete, a watchdog naming a failed stage; the ranks
  rendezvous through an authenticated control store of the job's own on 127.0.0.1, port picked by
  the kernel (:mod:`~flexpipe_dag.runtime.control_store`), not a TCPStore on every interface;
* ``python -m flexpipe_dag.runtime.score_launch`` under DeepSpeed's launcher with a hostfile, or
  ``torch.distributed.run``: ranks on several hosts, rendezvous from ``MASTER_ADDR`` /
  ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` (see ``deploy/MULTIHOST.md``).

DeepSpeed usage notes (checked with deepspeed 0.19.8 on CPU): ``engine.total_loss`` is reset to
``None`` before each ``eval_batch`` (it accumulates across calls and breaks on a new shape);
``eval_batch(..., compute_loss=True, reduce_output=None, bcast_loss=False)`` returns the
per-micro-batch ``loss_fn`` outputs on the last stage; the module is built with
``dynamic_shape=True`` so each batch may have its own length. The first ``init_distributed`` on a
CPU host JIT-compiles DeepSpeed's ``deepspeed_shm_comm`` op (40-60 s, cached under
``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.runtime.batch import MalformedRow, PromptRow, ResultSink
from flexpipe_dag.runtime.lifeline import follow_parent
from flexpipe_dag.runtime.model_loader import Checkpoint, resolve_checkpoint, resolve_dtype
from flexpipe_dag.runtime.scheduler import CONTEXT_REFUSAL
from flexpipe_dag.runtime.scoring import (
    FILLER,
    RowScores,
    ScoreCollector,
    ScoreUnit,
    build_units,
    padded_rows,
    plan_score_batches,
    unit_logprobs,
)

#: Shared counters per rank: eval batches finished, clock reading when the current one started (0 idle).
_FIELDS = 2
_F_BATCHES, _F_STARTED = range(_FIELDS)


@dataclass
class ScoreOptions:
    """How to run a scoring job.

    ``micro_batch_size``: rows per micro-batch; ``max_micro_batches``: micro-batches per
    ``eval_batch`` (stage overlap vs activation memory). ``step_timeout_s``: watchdog limit for one
    ``eval_batch``; ``start_timeout_s`` covers DeepSpeed's first-use JIT compile.
    ``keep_token_logprobs``: store every scored token's log-prob, not only sums.
    """

    micro_batch_size: int = 4
    max_micro_batches: int = 4
    dtype: str = "fp32"
    device: str = "cpu"
    backend: str | None = None
    threads_per_rank: int = 1
    step_timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    keep_token_logprobs: bool = True
    fault: dict = field(default_factory=dict)  # test hook: {"stage": s, "raise_after_batches": n}
    start_method: str = "forkserver"  # as RuntimeOptions.start_method


@dataclass
class ScoreSpec:
    """What every rank needs (picklable). Every rank derives the same batch plan from ``units``."""

    checkpoint_path: str
    checkpoint_name: str
    ranges: list[tuple[int, int]]
    units: list[ScoreUnit]
    micro_batch_size: int
    max_micro_batches: int
    pad_token_id: int
    dtype: str = "fp32"
    backend: str = "gloo"
    threads_per_rank: int = 1
    fault: dict = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.ranges)


@dataclass
class ScoreReport:
    """What a scoring job did. ``failure`` is the StageFailedError message when the run broke off."""

    rows: int
    malformed: list[MalformedRow]
    skipped_done: int
    submitted: int
    finished: int = 0
    units: int = 0
    scored_tokens: int = 0
    forward_tokens: int = 0
    elapsed_s: float = 0.0
    start_s: float = 0.0
    failure: str | None = None
    stage_info: list[dict] = field(default_factory=list)

    @property
    def forward_tokens_per_s(self) -> float:
        """Real (unpadded) tokens through the pipeline per second of scoring, start-up excluded."""
        return self.forward_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def run_score_rank(spec: ScoreSpec, emit: Callable[[tuple], None], counters=None, store=None) -> None:
    """Body of one rank. Rank, world size and rendezvous come from the environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), as set by DeepSpeed's
    launcher, ``torch.distributed.run``, or :func:`score_rank_main`; with ``store`` (a
    ``torch.distributed.Store``) the process group rendezvous through it instead, and DeepSpeed
    takes that group over.

    Emits ``("ready", stage, info)``, then on the last stage ``("scores", [(unit_index, [logprob, ...]), ...])``
    after each batch, and ``("done", stage)`` on every stage.

    Raises:
        InputError: ``WORLD_SIZE`` differs from the number of stages.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    import deepspeed
    import torch
    from deepspeed.utils import logger as ds_logger

    from flexpipe_dag.runtime.pipe_layers import gear_pipeline_module

    ds_logger.setLevel(logging.WARNING)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != spec.num_stages:
        raise InputError("WORLD_SIZE", None, f"expected one rank per stage ({spec.num_stages}), got {world}")
    torch.set_num_threads(spec.threads_per_rank)
    if spec.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if store is not None:
        import torch.distributed as dist

        dist.init_process_group(spec.backend, store=store, rank=int(os.environ["RANK"]), world_size=world,
                                timeout=timedelta(days=1))
    deepspeed.init_distributed(dist_backend=spec.backend, auto_mpi_discovery=False, verbose=False,
                               timeout=timedelta(days=1))
    stage = int(os.environ["RANK"])
    ckpt = Checkpoint(path=__import__("pathlib").Path(spec.checkpoint_path), name=spec.checkpoint_name)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if spec.backend == "nccl" else "cpu"
    module = gear_pipeline_module(ckpt, spec.ranges, resolve_dtype(spec.dtype, device))
    engine, *_ = deepspeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": spec.micro_batch_size, "gradient_accumulation_steps": 1,
        "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False})
    a, b = spec.ranges[stage]
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    emit(("ready", stage, {"stage_index": stage, "layer_start": a, "layer_end": b, "param_bytes": params,
                           "pipe_layers": [module.parts[stage], module.parts[stage + 1]], "pid": os.getpid()}))
    last = engine.is_last_stage()
    base = stage * _FIELDS
    for n, batch in enumerate(plan_score_batches(spec.units, spec.micro_batch_size, spec.max_micro_batches)):
        if spec.fault.get("stage") == stage and n >= spec.fault.get("raise_after_batches", 1 << 60):
            raise RuntimeError(f"injected fault after {n} batches")
        if counters is not None:
            counters[base + _F_STARTED] = time.monotonic()
        mbs = [torch.tensor(rows, dtype=torch.long) for rows in padded_rows(batch, spec.units, spec.pad_token_id)]
        engine.total_loss = None
        out = engine.eval_batch(iter([(x, x) for x in mbs]), compute_loss=True, reduce_output=None,
                                bcast_loss=False, num_micro_batches=len(mbs))
        if last:
            scores = []
            for slots, lp in zip(batch.micro_batches, out):
                rows = lp.tolist()
                scores += [(u, unit_logprobs(spec.units[u], rows[r])) for r, u in enumerate(slots) if u != FILLER]
            emit(("scores", scores))
        if counters is not None:
            counters[base + _F_STARTED] = 0.0
            counters[base + _F_BATCHES] = n + 1
    emit(("done", stage))


def score_rank_main(rank: int, spec: ScoreSpec, store_port: int, secret: str, events, counters) -> None:
    """Entry point of a spawned rank on this host: sets the rank's environment, joins the process
    group through the job's control store (``127.0.0.1:store_port``, proving ``secret``), runs
    :func:`run_score_rank`, reports ``("error", stage, message)`` and exits non-zero on failure."""
    follow_parent()  # leave with the head, however it ends; Ctrl-C is the head's to handle
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec.num_stages),
                       "LOCAL_SIZE": str(spec.num_stages), "MASTER_ADDR": "127.0.0.1",  # names DeepSpeed's shm only
                       "MASTER_PORT": str(store_port), "OMP_NUM_THREADS": str(spec.threads_per_rank)})
    try:
        from flexpipe_dag.runtime.rendezvous import process_group_store

        store = process_group_store("127.0.0.1", store_port, 300.0, secret)
        run_score_rank(spec, events.put, counters, store=store)
    except BaseException as exc:  # report, then die: the parent names this stage
        events.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
        raise SystemExit(1) from None
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def score_units(rows: list[PromptRow], tokenizer, malformed: list[MalformedRow] | None = None,
                max_context_tokens: int | None = None) -> tuple[list[ScoreUnit], dict[str, RowScores]]:
    """Tokenise rows (plain text, no chat template; continuations tokenised on their own and
    appended) into units; a row with nothing to score, or with a unit longer than
    ``max_context_tokens`` (the model's ``max_position_embeddings``; ``None``: not checked), goes to
    ``malformed`` with its reason."""
    units: list[ScoreUnit] = []
    state: dict[str, RowScores] = {}
    for r in rows:
        ids = list(r.token_ids) if r.token_ids is not None else tokenizer(r.prompt, add_special_tokens=False)["input_ids"]
        conts = None
        if r.continuations:
            conts = [list(c) if isinstance(c, list) else tokenizer(c, add_special_tokens=False)["input_ids"]
                     for c in r.continuations]
        try:
            row_units = build_units(r.request_id, ids, conts)
            check_unit_context(row_units, max_context_tokens)
        except ValueError as exc:
            if malformed is not None:
                malformed.append(MalformedRow(r.line, f"id {r.request_id!r}: {exc}"))
            continue
        units += row_units
        state[r.request_id] = RowScores(r.request_id, len(ids), len(row_units))
    return units, state


def check_unit_context(units: list[ScoreUnit], max_context_tokens: int | None) -> None:
    """Refuse a row whose longest unit exceeds the model's max context (``None``: not checked).

    Raises:
        ValueError: naming the unit (prompt, or prompt + continuation ``i``), its length and the limit.
    """
    if max_context_tokens is None:
        return
    for u in units:
        if len(u.token_ids) > max_context_tokens:
            what = "prompt" if u.choice is None else f"prompt + continuation {u.choice}"
            raise ValueError(f"{what}: {len(u.token_ids)} tokens {CONTEXT_REFUSAL} of {max_context_tokens} "
                             f"tokens; expected at most {max_context_tokens}")


def run_score_job(gear: Gear, rows: list[PromptRow], sink: ResultSink, *,
                  model: Checkpoint | str | os.PathLike | None = None, options: ScoreOptions | None = None,
                  malformed: list[MalformedRow] | None = None,
                  on_progress: Callable[[int, int], None] | None = None) -> ScoreReport:
    """Score the rows not yet in ``sink`` through DeepSpeed's pipeline engine on this host.

    One process per gear stage; a row's record (:func:`~flexpipe_dag.runtime.scoring.score_record`)
    is written the moment its last unit is scored, so a failed run keeps what finished and a re-run
    scores only the rest.

    Raises (before anything launches):
        InputError: the gear does not match the model.
        InfeasibleError: a stage has replicas or does not fit its device.
    Failures after launch (a stage crashed, raised, or made no progress for ``step_timeout_s``)
    end up in ``report.failure`` naming the stage.
    """
    from flexpipe_dag.runtime.pipeline import (
        RuntimeOptions,
        StageFailedError,
        check_gear_fits,
        check_gear_supported,
        process_context,
    )

    opts = options or ScoreOptions()
    ckpt = model if isinstance(model, Checkpoint) else resolve_checkpoint(model)
    check_gear_supported(gear)
    check_gear_fits(gear, ckpt, RuntimeOptions(dtype=opts.dtype, device=opts.device))
    malformed = list(malformed or [])
    done = sink.done_ids()
    todo = [r for r in rows if r.request_id not in done]
    tok = ckpt.tokenizer()
    units, state = score_units(todo, tok, malformed, ckpt.max_context_tokens)
    report = ScoreReport(rows=len(rows), malformed=malformed, skipped_done=len(rows) - len(todo),
                         submitted=len(state), units=len(units))
    if not units:
        return report
    pad = ckpt.config.pad_token_id if ckpt.config.pad_token_id is not None else 0
    spec = ScoreSpec(str(ckpt.path), ckpt.name, gear.layer_ranges(), units, opts.micro_batch_size,
                     opts.max_micro_batches, int(pad), opts.dtype,
                     opts.backend or ("nccl" if opts.device == "cuda" else "gloo"), opts.threads_per_rank,
                     dict(opts.fault))
    collector = ScoreCollector(units, state, sink, gear.gear_id, opts.keep_token_logprobs)
    ctx = process_context(opts.start_method)
    events = ctx.Queue()
    counters = ctx.RawArray("d", _FIELDS * spec.num_stages)
    from flexpipe_dag.runtime.control_auth import new_secret
    from flexpipe_dag.runtime.control_store import ControlStoreServer

    secret = new_secret()
    control = ControlStoreServer("127.0.0.1", 0, secret)  # loopback only, the kernel's port: no race
    procs = [ctx.Process(target=score_rank_main, name=f"flexpipe-score-{s}", daemon=True,
                         args=(s, spec, control.port, secret, events, counters)) for s in range(spec.num_stages)]
    t_launch = time.monotonic()
    for p in procs:
        p.start()
    info: dict[int, dict] = {}
    finished_stages: set[int] = set()
    t_scoring: float | None = None
    last_progress = time.monotonic()

    def fail(stage, reason):
        codes = {s: p.exitcode for s, p in enumerate(procs)}
        killed = [s for s, c in codes.items() if c is not None and c < 0]
        if killed and not reason.startswith("watchdog"):
            stage, reason = killed[0], f"process killed by signal {-codes[killed[0]]}"
        raise StageFailedError(stage, reason)

    try:
        while len(finished_stages) < spec.num_stages:
            try:
                ev = events.get(timeout=0.1)
            except queue.Empty:
                ev = None
            now = time.monotonic()
            if ev is not None:
                last_progress = now
                if ev[0] == "error":
                    time.sleep(0.3)  # let a signal-killed peer's exit code show
                    fail(ev[1], ev[2])
                elif ev[0] == "ready":
                    info[ev[1]] = ev[2]
                    if len(info) == spec.num_stages:
                        t_scoring = now
                elif ev[0] == "scores":
                    for _ in collector.add(ev[1]):
                        report.finished = collector.finished
                        if on_progress:
                            on_progress(report.finished, report.submitted)
                elif ev[0] == "done":
                    finished_stages.add(ev[1])
            for s, p in enumerate(procs):
                if p.exitcode not in (None, 0):  # a rank exits 0 only after reporting "done"
                    fail(s, f"process exited with code {p.exitcode}")
            if len(info) < spec.num_stages and now - t_launch > opts.start_timeout_s:
                missing = sorted(set(range(spec.num_stages)) - set(info))
                fail(missing[0], f"did not start within {opts.start_timeout_s:.0f} s")
            if t_scoring is not None and now - last_progress > opts.step_timeout_s:
                done_batches = [counters[s * _FIELDS + _F_BATCHES] for s in range(spec.num_stages)]
                laggard = done_batches.index(min(done_batches))
                fail(laggard, f"watchdog: no progress for {now - last_progress:.1f} s; this stage has finished "
                              f"the fewest batches ({int(done_batches[laggard])}) (limit {opts.step_timeout_s:.0f} s)")
    except StageFailedError as exc:
        report.failure = str(exc)
    except BaseException:  # interrupted (a stop signal, flexpipe_dag.runtime.stop): end the ranks now
        report.failure = "interrupted"
        raise
    finally:
        for p in procs:
            p.join(timeout=10 if report.failure is None else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        control.close()
    report.finished, report.scored_tokens = collector.finished, collector.scored_tokens
    report.forward_tokens = collector.forward_tokens
    report.stage_info = [info[s] for s in sorted(info)]
    report.start_s = (t_scoring or time.monotonic()) - t_launch
    report.elapsed_s = time.monotonic() - (t_scoring or time.monotonic())
    return report
