"""Stage workers placed and started by Ray (:mod:`flexpipe_dag.runtime.ray_placement`), on CPU with SmolLM2.

A local Ray cluster of two nodes on this host (module fixture, ~15 s): the head node offers the
custom resource ``flexpipe_host_node-a``, a second node ``flexpipe_host_node-b`` (started in its own
session, so a test can kill it alone). A 2-stage pipeline puts stage 1 on node B; a gear shift moves
it to node A; ``flexpipe run --ray --cluster`` places a gear's stages from a cluster profile; a killed node B
is named and its lane's requests finish on the fallback lane (last: node B does not come back). Outputs are
compared with single-process transformers greedy ``generate`` (``hf_reference``).

The cluster uses its own port and ``--temp-dir`` and is stopped by killing the process groups this
fixture started (never ``ray stop``, which would end every Ray cluster of the host). Without ray, or
when a cluster cannot be started here, the cluster tests skip saying why.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytest.importorskip("torch")

from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.runtime.ray_placement import (
    RESOURCE_PREFIX,
    RayPlacement,
    RayUnavailableError,
    connect_ray,
    host_resource,
    import_ray,
)
from tests.support import REPO, unused_port, wait_until
from tests.test_runtime_helpers import checkpoint, gear, requests

HOSTS = {"a0": "node-a", "a1": "node-a", "b0": "node-b", "b1": "node-b"}
FAST_SHIFT = dict(warmup_requests=1, warmup_max_new_tokens=4, health_window_s=1.0, probe_interval_s=0.5,
                  warmup_timeout_s=240.0, drain_timeout_s=120.0, probe_timeout_s=60.0)
IDLE_TIMEOUT_S = 180.0


# -- without a cluster ----------------------------------------------------------------------------
def test_resource_convention_and_host_mapping(lab_profile):
    assert host_resource("gpu-v100-1") == RESOURCE_PREFIX + "gpu-v100-1" == "flexpipe_host_gpu-v100-1"
    g = gear([(0, 15), (15, 30)], device_ids=[["a0"], ["b0", "b1"]])
    places = RayPlacement(hosts=HOSTS).workers(g)
    assert [(p.worker, p.stage, p.replica, p.host, p.resource) for p in places] == [
        (0, 0, 0, "node-a", "flexpipe_host_node-a"), (1, 1, 0, "node-b", "flexpipe_host_node-b"),
        (2, 1, 1, "node-b", "flexpipe_host_node-b")]
    with pytest.raises(InputError, match=r"stage 1 runs on device 'c0', which no host holds"):
        RayPlacement(hosts=HOSTS).workers(gear([(0, 15), (15, 30)], device_ids=[["a0"], ["c0"]]))
    from_profile = RayPlacement.from_profile(lab_profile)
    dev = lab_profile.devices[0]
    assert from_profile.hosts[dev.device_id] == dev.node_id


def test_missing_ray_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(RayUnavailableError, match=r'pip install "ray\[default\]'):
        import_ray()


def test_run_flags_for_ray_placement_are_checked(capsys):
    from flexpipe_dag.cli import main

    assert main(["run", "--stages", "2", "--trace", "azure-conv", "--ray", "127.0.0.1:1"]) == 2
    assert "--cluster" in capsys.readouterr().err
    assert main(["run", "--stages", "2", "--trace", "azure-conv", "--cluster", "c.yaml"]) == 2
    assert "only with --ray" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one way of starting the workers
        main(["run", "--stages", "2", "--trace", "azure-conv", "--ray", "127.0.0.1:1", "--listen", "127.0.0.1:0"])
    assert "--listen: not allowed with argument --ray" in capsys.readouterr().err
    assert main(["serve", "--stages", "2", "--no-store", "--ray", "127.0.0.1:1"]) == 2  # every gear it serves
    assert "--cluster" in capsys.readouterr().err


#: A fleet-form cluster profile of the two test hosts (devices node-a-gpu0/1, node-b-gpu0/1).
FLEET = """cluster_id: two-nodes
fleet:
  - {node_id: node-a, gpu_model: T4, count: 2}
  - {node_id: node-b, gpu_model: T4, count: 2}
inter_node: {bandwidth_gbps: 12.5, latency_us: 25}
"""


# -- a two-node cluster on this host --------------------------------------------------------------
class LocalRayCluster:
    """A head node and a second node, each in its own session (process group), on 127.0.0.1."""

    def __init__(self):
        self.port = unused_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="fpray-", dir="/tmp")  # short: Ray's socket paths are bounded
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                        OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        RAY_USAGE_STATS_ENABLED="0")
        self.sessions: dict[str, int] = {}  # node -> its session / process group id
        self.ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"

    def _start(self, name: str, args: list[str]) -> None:
        log = open(os.path.join(self.temp_dir, f"{name}.log"), "w")
        proc = subprocess.Popen([self.ray_bin, "start", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                                 "--disable-usage-stats", *args], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.sessions[name] = proc.pid  # the daemons `ray start` leaves keep its session and group
        code = proc.wait(timeout=120)
        if code != 0:
            with open(log.name) as f:
                tail = f.read()[-800:]
            raise RuntimeError(f"`ray start` for {name} exited {code}: {tail}")

    def start(self) -> None:
        self._start("node-a", ["--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}",
                               f"--ray-client-server-port={unused_port()}", "--include-dashboard=false",
                               f"--resources={{\"{host_resource('node-a')}\": 4}}"])
        self._start("node-b", [f"--address={self.address}", f"--resources={{\"{host_resource('node-b')}\": 4}}"])

    def node_id(self, host: str) -> str:
        ray = import_ray()
        return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and host_resource(host) in n["Resources"])

    def kill(self, name: str) -> None:
        """SIGKILL a node's daemons (raylet, agents) by their process group."""
        pgid = self.sessions.pop(name, None)
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        for name in list(self.sessions)[::-1]:
            self.kill(name)
        time.sleep(1.0)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    try:
        import_ray()
    except RayUnavailableError as exc:
        pytest.skip(str(exc))
    c = LocalRayCluster()
    try:
        c.start()
        connect_ray(_placement(c))  # this process joins once; the runtimes reuse the connection
    except Exception as exc:
        c.stop()
        pytest.skip(f"cannot start a local Ray cluster here: {exc}")
    try:
        yield c
    finally:
        ray = import_ray()
        if ray.is_initialized():
            ray.shutdown()
        c.stop()


def _placement(c: LocalRayCluster) -> RayPlacement:
    return RayPlacement(hosts=HOSTS, address=c.address, node_ip_address="127.0.0.1",
                        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, connect_timeout_s=120)


def _options(c: LocalRayCluster):
    from flexpipe_dag.runtime.pipeline import RuntimeOptions

    return RuntimeOptions(placement=_placement(c), start_timeout_s=240, step_timeout_s=120)


def test_a_host_without_a_ray_node_is_named(cluster):
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions

    placement = RayPlacement(hosts={**HOSTS, "c0": "node-c"}, address=cluster.address, node_ip_address="127.0.0.1")
    rt = PipelineRuntime(gear([(0, 15), (15, 30)], device_ids=[["a0"], ["c0"]]), checkpoint(),
                         RuntimeOptions(placement=placement))
    with pytest.raises(InfeasibleError, match=r"host 'node-c' \(stage 1\) has no Ray node.*'flexpipe_host_node-c'"):
        rt.start()
    assert not rt.stage_pids()  # nothing was started


class Sink:
    """Outputs by request id, with a count of deliveries (a duplicate cannot hide)."""

    def __init__(self):
        self.outputs: dict[str, list[int]] = {}
        self.deliveries: dict[str, int] = {}
        self.refused: dict[str, str] = {}
        self.first = threading.Event()

    def __call__(self, out) -> None:
        self.deliveries[out.request_id] = self.deliveries.get(out.request_id, 0) + 1
        self.outputs[out.request_id] = list(out.output_token_ids)
        self.first.set()

    def check(self, submitted: list[str]) -> None:
        from tests.test_runtime_helpers import hf_reference

        ref = hf_reference()
        assert not self.refused
        assert sorted(self.deliveries) == sorted(submitted), "a request was lost"
        assert set(self.deliveries.values()) == {1}, "a request was delivered twice"
        wrong = {rid: t for rid, t in self.outputs.items() if t != ref[rid.split("-")[-1]]}
        assert not wrong, f"outputs differ from transformers generate: {wrong}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stage_placed_on_its_host_and_a_shift_moves_it_to_another(cluster):
    from flexpipe_dag.runtime.pipeline import PipelineRuntime
    from flexpipe_dag.shift import GearExecutor, ServingRouter, ShiftConfig

    node_a, node_b = cluster.node_id("node-a"), cluster.node_id("node-b")
    sink = Sink()
    router = ServingRouter(on_result=sink, on_refused=lambda rid, why: sink.refused.__setitem__(rid, why))
    try:
        t = time.monotonic()
        router.open(PipelineRuntime(gear([(0, 15), (15, 30)], micro_batch_size=4, gear_id="ab",
                                         device_ids=[["a0"], ["b0"]]), checkpoint(), _options(cluster)))
        print(f"pipeline on node-a + node-b started in {time.monotonic() - t:.1f} s")
        old = router.active.runtime
        where = old.placement
        assert [(w["stage"], w["host"], w["ray_node_id"]) for w in where] == [(0, "node-a", node_a),
                                                                             (1, "node-b", node_b)]
        assert old.stage_pids() == [w["pid"] for w in where]  # the stage workers are the actors' processes
        submitted = router.submit(requests(8, prefix="before-"))
        # the shift: stage 1 moves from node B (device b0) to node A (device a1); the new gear's workers
        # are started by Ray on node A because the options (and so the placement) are inherited
        t = time.monotonic()
        outcome = GearExecutor(router, ShiftConfig(**FAST_SHIFT)).shift(
            gear([(0, 12), (12, 30)], micro_batch_size=4, gear_id="aa", device_ids=[["a0"], ["a1"]]))
        print(f"shift: {outcome.status} in {time.monotonic() - t:.1f} s ({outcome.mode}): {outcome.timings_s}")
        assert outcome.status == "done", outcome.reason
        new = router.active.runtime
        assert new is not old and new.gear.gear_id == "aa"
        assert [(w["stage"], w["host"], w["ray_node_id"]) for w in new.placement] == [(0, "node-a", node_a),
                                                                                      (1, "node-a", node_a)]
        submitted += router.submit(requests(8, prefix="after-"))
        assert router.wait_idle(timeout_s=IDLE_TIMEOUT_S), f"{router.ledger.num_open()} requests still open"
        sink.check(submitted)
        old_pids = [w["pid"] for w in where]
        wait_until(lambda: all(not os.path.exists(f"/proc/{p}") for p in old_pids), 30,
                   "the old gear's Ray actors to end after its release")
    finally:
        router.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flexpipe_run_places_stages_with_ray_from_a_cluster_profile(cluster, tmp_path, capsys):
    import json

    from flexpipe_dag.cli import main
    from tests.test_runtime_helpers import hf_reference

    profile = tmp_path / "cluster.yaml"
    profile.write_text(FLEET)
    gear_file = tmp_path / "gear.json"
    gear_file.write_text(gear([(0, 10), (10, 30)], micro_batch_size=4, gear_id="cli",
                              device_ids=[["node-a-gpu0"], ["node-b-gpu0"]]).model_dump_json())
    reqs = requests(4, prefix="cli-")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": r.request_id, "token_ids": r.prompt_token_ids,
                                           "max_new_tokens": r.max_new_tokens}) + "\n" for r in reqs))
    out = tmp_path / "out.jsonl"
    code = main(["run", "--gear", str(gear_file), "--prompts", str(prompts), "--out", str(out), "--ray", cluster.address,
                 "--cluster", str(profile), "--ray-node-ip", "127.0.0.1", "--max-new-tokens", "64"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert "placing 2 stage workers with Ray" in err
    rows = {json.loads(line)["id"]: json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()}
    assert rows == {r.request_id: hf_reference()[r.request_id.split("-")[-1]] for r in reqs}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_node_is_named_and_its_requests_finish_elsewhere(cluster):
    """Last in the module: node B does not come back."""
    from flexpipe_dag.runtime.pipeline import PipelineRuntime
    from flexpipe_dag.shift import ServingRouter

    sink = Sink()
    router = ServingRouter(on_result=sink, on_refused=lambda rid, why: sink.refused.__setitem__(rid, why))
    try:
        router.open(PipelineRuntime(gear([(0, 15), (15, 30)], micro_batch_size=2, inflight=2, gear_id="ab",
                                         device_ids=[["a0"], ["b0"]]), checkpoint(), _options(cluster)))
        victim = router.active
        fallback = router.add_lane(_started(PipelineRuntime(gear([(0, 30)], micro_batch_size=4, gear_id="a",
                                                                  device_ids=[["a1"]]), checkpoint(), _options(cluster))),
                                   state="standby")
        router.fallback = fallback
        on_b = [w["pid"] for w in victim.runtime.placement if w["host"] == "node-b"]
        submitted = router.submit(requests(8, prefix="kill-"))
        assert sink.first.wait(120), "no request finished on the pipeline before the kill"
        t = time.monotonic()
        cluster.kill("node-b")  # the node's raylet and agents ...
        for pid in on_b:  # ... and its worker processes (they would follow their raylet within seconds)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: router.failures, 60, "the router to see the lane on node B fail")
        named_s = time.monotonic() - t
        lane_id, reason = router.failures[0]
        print(f"named after {named_s:.1f} s: {reason}")
        assert lane_id == victim.lane_id
        assert "stage 1" in reason and "node-b" in reason, reason
        assert router.wait_idle(timeout_s=IDLE_TIMEOUT_S), f"{router.ledger.num_open()} requests still open"
        sink.check(submitted)  # every request finished once, on node A's lane if not before the kill
        assert router.active is fallback
        assert router.ledger.moved > 0, "nothing was in flight on node B when it was killed"
    finally:
        router.close()


def _started(rt):
    rt.start()
    return rt
