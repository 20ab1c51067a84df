"""Stage workers started outside the head (other hosts, here other process trees on this host):
``flexpipe worker --head``, ``flexpipe run --launched`` under ``torch.distributed.run``, the control
store's refusals, and a killed remote stage named by the head with finished outputs kept.

Ports: a head here listens on ``127.0.0.1:0`` and the workers are pointed at the port it reports
(:meth:`PipelineRuntime.listen`); only the launchers, which must be handed their ports up front,
get guessed ports, retried when another process took one meanwhile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("torch")

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime.observations import ObservationCollector
from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, StageFailedError
from flexpipe_dag.runtime.remote import ControlServer, connect, parse_address, serve_stage
from flexpipe_dag.runtime.worker import WorkerSpec
from tests.support import (
    MODEL_CACHE,
    BackgroundThread,
    PortClash,
    hold_unused_port,
    is_port_clash,
    retry_on_port_clash,
    unused_port,
    wait_until,
)
from tests.test_runtime_helpers import checkpoint, gear, hf_reference, requests, signal_after_first_result

pytestmark = pytest.mark.slow
UNEVEN3 = [(0, 7), (7, 26), (26, 30)]
#: The head binds a free port itself and reports it (``listen()``); workers are started after.
ANY_PORT = "127.0.0.1:0"
#: A launcher's whole run (3 ranks load the model; ~280 s for deepspeed on a loaded 2-core host).
LAUNCH_TIMEOUT_S = 600


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", FLEXPIPE_MODEL_CACHE=MODEL_CACHE, HF_HUB_OFFLINE="1")
    env.pop("FLEXPIPE_FAULT", None)
    return env


#: A run secret for tests that hand one to the head themselves.
SECRET = "test-secret-" + "0123456789abcdef" * 3


def _workers(address: str, stages: int, replicas: list[int] | None = None,
             secret: str | None = None) -> list[subprocess.Popen]:
    """One ``flexpipe worker`` process per stage replica, in its own session (not a child of the runtime),
    holding the run ``secret`` (in FLEXPIPE_RUN_SECRET; ``None``: this process's environment)."""
    env = _env() if secret is None else dict(_env(), FLEXPIPE_RUN_SECRET=secret)
    return [subprocess.Popen([sys.executable, "-m", "flexpipe_dag.cli", "worker", "--head", address, "--stage", str(s),
                              "--replica", str(k)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            for s, r in enumerate(replicas or [1] * stages) for k in range(r)]


def _reap(procs: list[subprocess.Popen], timeout_s: float = 30) -> list[int | None]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
            codes.append(None)
    return codes


def test_remote_stage_workers_match_hf_generate_and_exit_cleanly():
    ref = hf_reference()
    reqs = requests(8, prefix="remote-")
    rt = PipelineRuntime(gear(UNEVEN3, micro_batch_size=4), checkpoint(),
                         RuntimeOptions(control_address=ANY_PORT, start_timeout_s=240))
    procs = _workers(rt.listen(), 3, secret=rt.secret)
    try:
        with rt:
            assert [(i["layer_start"], i["layer_end"]) for i in rt.stage_info] == UNEVEN3
            assert rt.stage_pids() == [p.pid for p in procs]  # the stages are those processes
            collector = ObservationCollector(rt, "remote")
            outs = rt.generate(reqs)
            observed: list = []

            def every_stage_reported_alike() -> bool:  # rows arrive with the heartbeats (every 0.2 s)
                observed.extend(collector.collect())
                counts = [sum(o.stage_index == s for o in observed) for s in range(3)]
                return bool(counts[0]) and len(set(counts)) == 1

            wait_until(every_stage_reported_alike, 10, "every stage's observation rows to reach the head",
                       interval_s=0.2)
    finally:
        rt.shutdown()
        codes = _reap(procs)
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id.split("-")[-1]]
                                                                 for r in reqs}
    assert codes == [0, 0, 0]  # the head's STOP ended every worker
    # every stage's measured steps reached the head (calibration input), with times on its clock
    by_stage = [[o for o in observed if o.stage_index == s] for s in range(3)]
    assert all(by_stage) and len({len(rows) for rows in by_stage}) == 1  # each micro-batch once per stage
    assert [(rows[0].layer_start, rows[0].layer_end) for rows in by_stage] == UNEVEN3
    assert all(o.wall_ms > 0 and o.t_s >= -1.0 for o in observed)


def test_remote_replicated_stage_matches_hf_generate():
    ref = hf_reference()
    reqs = requests(8, prefix="remote-rep-")
    g = gear([(0, 12), (12, 30)], micro_batch_size=2, device_ids=[["a"], ["b", "c"]])
    rt = PipelineRuntime(g, checkpoint(), RuntimeOptions(control_address=ANY_PORT, start_timeout_s=240))
    procs = _workers(rt.listen(), 2, replicas=[1, 2], secret=rt.secret)
    try:
        with rt:
            assert [(i["stage_index"], i["replica_index"]) for i in rt.stage_info] == [(0, 0), (1, 0), (1, 1)]
            outs = rt.generate(reqs)
    finally:
        rt.shutdown()
        codes = _reap(procs)
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id.split("-")[-1]]
                                                                 for r in reqs}
    assert codes == [0, 0, 0]


def test_killed_remote_stage_is_named_and_finished_outputs_kept():
    rt = PipelineRuntime(gear([(0, 15), (15, 30)], micro_batch_size=2), checkpoint(),
                         RuntimeOptions(control_address=ANY_PORT, start_timeout_s=240))
    procs = _workers(rt.listen(), 2, secret=rt.secret)
    finished: list = []
    try:
        with rt:
            reqs = requests(8, prefix="kill-remote-")
            for r in reqs:  # long enough that work is in flight when stage 1 dies
                r.max_new_tokens, r.eos_token_ids = 40, ()
            kill_stage1 = signal_after_first_result(procs[1].pid, signal.SIGKILL, finished)  # stage 1's process
            with pytest.raises(StageFailedError) as err:
                rt.generate(reqs, on_result=kill_stage1)
    finally:
        rt.shutdown()
        codes = _reap(procs)
    assert err.value.stage == 1, err.value.reason
    assert "heartbeat" in err.value.reason
    assert finished and {o.request_id for o in err.value.finished} == {o.request_id for o in finished}
    assert codes[1] == -signal.SIGKILL and codes[0] is not None and codes[0] != 0  # no orphan left behind


def test_head_without_workers_says_how_to_start_them():
    options = RuntimeOptions(control_address=ANY_PORT, start_timeout_s=2)
    rt = PipelineRuntime(gear([(0, 15), (15, 30)]), checkpoint(), options)
    address = rt.listen()
    assert address.startswith("127.0.0.1:") and address != ANY_PORT  # the port it bound, not 0
    with pytest.raises(StageFailedError) as err:
        rt.start()
    assert err.value.stage == 0 and "--stage 0" in err.value.reason
    assert f"flexpipe worker --head {address} " in err.value.reason  # the address workers can reach


def test_control_store_refuses_a_second_worker_and_a_stage_outside_the_gear():
    server = ControlServer(0, 3)
    address = f"127.0.0.1:{server.port}"
    try:
        server.publish(WorkerSpec(str(checkpoint().path), checkpoint().name, [(0, 15), (15, 30)], 8, 16,
                                  replicas=[1, 2]))
        connect("127.0.0.1", server.port, 10, server.secret).claim(2)  # stage 1 replica 1 already has a worker
        with pytest.raises(InputError, match="stage 1 replica 1 already has a worker"):
            serve_stage(address, 1, replica=1, connect_timeout_s=10, secret=server.secret)
        with pytest.raises(InputError, match="2 stages"):
            serve_stage(address, 5, connect_timeout_s=10, secret=server.secret)
        with pytest.raises(InputError, match="stage 1 has 2 replica"):
            serve_stage(address, 1, replica=2, connect_timeout_s=10, secret=server.secret)
        with pytest.raises(InputError, match="launch 4 ranks"):
            serve_stage(address, worker=3, connect_timeout_s=10, secret=server.secret)
        assert server.claimed() == [2]  # a refused worker claims nothing and tells the head nothing
    finally:
        server.close()


def test_worker_without_a_head_says_so():
    with hold_unused_port() as port, pytest.raises(InputError, match="no FlexPipe head answered"):
        serve_stage(f"127.0.0.1:{port}", 0, connect_timeout_s=2, secret=SECRET)


@pytest.mark.parametrize("text", ["nohost", "host:", ":29500", "host:99999", "host:abc", "127.0.0.1:29500:5", "::1:29500"])
def test_bad_head_address(text):
    with pytest.raises(InputError, match="HOST:PORT"):
        parse_address(text, "--head")


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "deepspeed"])
def test_run_launched_under_a_launcher(tmp_path, launcher):
    """The launcher path: 3 ranks = head + 2 stages, outputs identical to transformers ``generate``."""
    ids = [r.request_id for r in requests(4, prefix="launch-")]
    prompts = tmp_path / "prompts.jsonl"
    ref = hf_reference()
    prompts.write_text("".join(json.dumps({"id": r.request_id, "token_ids": r.prompt_token_ids, "max_new_tokens":
                                           r.max_new_tokens}) + "\n" for r in requests(4, prefix="launch-")))
    out = tmp_path / "out.jsonl"

    def launch() -> subprocess.CompletedProcess:
        # a launcher and its ranks must agree on the ports before any of them binds one: guessed
        # here, and the whole launch retried if another process took one meanwhile
        port = unused_port()
        if launcher == "deepspeed":  # its single-host form; a hostfile spreads the same ranks over hosts
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "3", "--master_port", str(port),
                   "--module", "flexpipe_dag.cli"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "3",
                   "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "flexpipe_dag.cli"]
        cmd += ["run", "--launched", "--control-port", str(unused_port()), "--stages", "2", "--prompts", str(prompts),
                "--out", str(out), "--max-new-tokens", "64"]
        try:
            proc = subprocess.run(cmd, env=dict(_env(), FLEXPIPE_RUN_SECRET=SECRET), capture_output=True, text=True,
                                  timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"timed out after {LAUNCH_TIMEOUT_S} s waiting for {launcher} to finish; stderr: "
                                 f"{(exc.stderr or b'')[-3000:]!r}") from None
        if proc.returncode != 0 and is_port_clash(proc.stderr):
            out.unlink(missing_ok=True)
            raise PortClash(proc.stderr[-1000:])
        return proc

    proc = retry_on_port_clash(launch, f"flexpipe run --launched under {launcher}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])  # launcher logs follow
    assert summary["finished"] == 4 and summary["failure"] is None, summary
    rows = {json.loads(line)["id"]: json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()}
    assert rows == {i: ref[i.split("-")[-1]] for i in ids}


def test_batch_inference_job_serves_stage_workers_started_elsewhere(tmp_path, monkeypatch):
    """The Dagster job as a multi-host user runs it: the job with ``control_address`` (port 0: the
    head picks one and logs it), and the workers pointed at that address once it listens."""
    from flexpipe_dag.jobs.batch import batch_inference
    from flexpipe_dag.resources.store_resource import StoreResource

    monkeypatch.setenv("FLEXPIPE_RUN_SECRET", SECRET)  # the head takes it, the workers inherit it
    listening: list[str] = []  # the address the job's head bound, as its run log names it
    listen = PipelineRuntime.listen
    monkeypatch.setattr(PipelineRuntime, "listen", lambda self: listening.append(listen(self)) or listening[-1])
    procs: list[subprocess.Popen] = []
    job_over = threading.Event()

    def start_workers() -> None:
        if wait_until(lambda: listening or job_over.is_set(), 240, "the batch job's head to listen"):
            if listening:
                procs.extend(_workers(listening[0], 2))

    starter = BackgroundThread(start_workers, name="start-workers")
    starter.start()
    store = StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}")
    try:
        result = batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": {
            "job_key": "remote-1", "trace": "azure-conv", "num_requests": 6, "max_prompt_tokens": 32,
            "max_new_tokens": 4, "stages": 2, "control_address": ANY_PORT}}}}, resources={"store": store})
    finally:
        job_over.set()
        starter.join(timeout=30)
        codes = _reap(procs)
    starter.join_or_fail(0)
    assert listening and not listening[0].endswith(":0"), listening
    assert result.success and codes == [0, 0]
    (job,) = store.get_store().jobs()
    assert job.status == "done" and len(store.get_store().results(job.id)) == 6
    (run,) = store.get_store().observed_runs()  # the remote stages shipped their steps; no cluster names them
    assert run["gear_key"] == "uniform-2" and run["cluster_key"] is None and run["steps"] > 0


def test_a_refused_worker_claims_nothing_and_leaves_the_head_alone(tmp_path):
    """Wrong --device or other weights: refused before claiming, no event to the head."""
    import shutil

    ck = checkpoint()
    server = ControlServer(0, 2)
    address = f"127.0.0.1:{server.port}"
    try:
        server.publish(WorkerSpec(str(ck.path), ck.name, [(0, 15), (15, 30)], 8, 16, checkpoint_fingerprint=ck.fingerprint))
        with pytest.raises(InputError, match="--device"):
            serve_stage(address, 1, device="cuda", connect_timeout_s=10, secret=server.secret)
        other = tmp_path / ck.path.name  # same name, other weights: a changed config
        other.mkdir()
        for f in ck.path.iterdir():
            if f.is_file():
                os.link(f, other / f.name) if f.name != "config.json" else shutil.copy(f, other / f.name)
        cfg = json.loads((other / "config.json").read_text())
        cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 2
        (other / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(InputError, match="other weights"):
            serve_stage(address, 1, model=str(other), connect_timeout_s=10, secret=server.secret)
        import queue

        events: queue.Queue = queue.Queue()
        server.poll(events, [0.0] * 12)
        assert server.claimed() == [] and events.empty()
    finally:
        server.close()


def test_fingerprint_follows_the_weights_not_the_path(tmp_path):
    ck = checkpoint()
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for f in ck.path.iterdir():
        if f.is_file():
            os.link(f, copy / f.name)
    from flexpipe_dag.runtime.model_loader import Checkpoint

    assert Checkpoint(copy, "renamed").fingerprint == ck.fingerprint


def test_worker_at_a_port_that_is_not_a_head_gives_up_in_time():
    import socket
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)  # accepts, never answers
    t0 = time.monotonic()
    try:
        with pytest.raises(InputError, match="no FlexPipe head answered"):
            serve_stage(f"127.0.0.1:{srv.getsockname()[1]}", 0, connect_timeout_s=2, secret=SECRET)
    finally:
        srv.close()
    assert time.monotonic() - t0 < 10


def test_run_flags_for_remote_stages_are_checked(capsys):
    from flexpipe_dag.cli import main

    assert main(["run", "--stages", "2", "--trace", "azure-conv", "--control-port", "29501"]) == 2
    assert "--control-port" in capsys.readouterr().err
    assert main(["run", "--stages", "2", "--trace", "azure-conv", "--listen", "127.0.0.1:29501:5"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
