"""`flexpipe serve --instances N` / `--max-instances M`: several pipeline instances of the served gear behind
the one router (real one-stage CPU SmolLM2 pipelines, driven through the `openai` SDK): greedy outputs equal
transformers' `generate`, both instances serve, the fleet scaler scales out under load and every request is
answered once; flags whose meaning is unclear are refused before a model loads; an extra instance that
cannot start stops the server with exit status 1 and the reason."""

from __future__ import annotations

import argparse
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from flexpipe_dag.core.errors import InputError
from tests.support import wait_until
from tests.test_frontdoor import MODEL, Server, _metrics, _pipeline_series
from tests.test_runtime_helpers import MAX_NEW_TOKENS, checkpoint, hf_reference, prompt_ids

#: How long a server may take to start its instances, or the scaler to add one, on a loaded 2-core host, s.
START_TIMEOUT_S = 240.0


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(client: openai.OpenAI, i: int) -> tuple[int, str, int]:
    """Prompt ``i % 8`` of the runtime tests (token ids, greedy): ``(prompt index, text, completion tokens)``."""
    k = i % len(prompt_ids())
    out = client.completions.create(model=MODEL, prompt=list(prompt_ids()[k]), max_tokens=MAX_NEW_TOKENS,
                                    temperature=0)
    return k, out.choices[0].text, out.usage.completion_tokens


def _check_exact(results: list[tuple[int, str, int]]) -> None:
    """Every answer is transformers' greedy ``generate`` of its prompt (text and token count)."""
    ref, tok = hf_reference(), checkpoint().tokenizer()
    for k, text, completion_tokens in results:
        assert text == tok.decode(ref[str(k)], skip_special_tokens=True), k
        assert completion_tokens == len(ref[str(k)]), k


def _instances(url: str) -> list[dict]:
    """``/ready``'s per-instance status."""
    return httpx.get(url + "/ready").json()["instances"]


def _serve_args(*args: str) -> argparse.Namespace:
    from flexpipe_dag.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *args])


@pytest.mark.slow
def test_two_instances_answer_concurrent_greedy_requests_exactly_and_both_serve(tmp_path):
    hf_reference()
    checkpoint()  # converted once into the shared cache before the server reads it
    srv = Server("--stages", "1", "--instances", "2", "--port", "0",  # a serving run of the store (SQLite) too
                 env={"FLEXPIPE_HOME": str(tmp_path)})
    try:
        url = srv.wait_bound(START_TIMEOUT_S)
        assert httpx.get(url + "/health").json() == {"status": "ok", "instances": 2}
        client = _client(url)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: _greedy(client, i), range(16)))
        _check_exact(results)
        status = _instances(url)
        assert [s["gear_id"] for s in status] == ["uniform-1", "uniform-1"]
        assert all(s["requests_finished"] >= 1 for s in status), status  # the router spread them
        assert sum(s["requests_finished"] for s in status) == 16 and all(s["open_requests"] == 0 for s in status)
        metrics = _metrics(url)
        assert metrics[("flexpipe_instances", "")] == 2
        assert metrics[("flexpipe_e2e_request_latency_seconds_count", "online")] == 16
        assert metrics[("flexpipe_instance_changes_total", "out")] == 0  # no scaler without --max-instances
        # each instance's KV pool is its own series (before, the two overwrote one series per stage)
        series = {(s["instance_id"], "0") for s in status}  # one stage each
        assert len(series) == 2
        wait_until(lambda: set(_pipeline_series(url)) == series, 10.0, "a sample of each instance")
        free = _pipeline_series(url)
        assert all(v > 0 for v in free.values()), free
    finally:
        assert srv.stop() == 0
    log = "\n".join(srv.lines)
    assert "instance 2 of 2 live" in log and "samples to the store, shifts from gear_shift runs" in log, log[-3000:]
    # the store's serving stream: one sample per round of both instances' windows (the fleet's load), never
    # a finished request counted twice
    from flexpipe_dag.sql.store import Store

    samples = [smp for _, smp in Store.from_url(f"sqlite:///{tmp_path / 'flexpipe.db'}").read_samples()]
    assert any(smp.instances == 2 for smp in samples), [(smp.t_s, smp.instances) for smp in samples]
    assert sum(smp.completed for smp in samples) <= 16


@pytest.mark.parametrize(("argv", "message"), [
    (["--stages", "1", "--instances", "0"], "--instances: expected an integer >= 1"),
    (["--stages", "1", "--instances", "3", "--max-instances", "2"],
     "--max-instances: expected an integer >= 3 .*at least --instances 3"),
    (["--stages", "1", "--max-instances", "2"], "--max-instances: gear uniform-1: the gear has no measured envelope "
                                                ".*`flexpipe plan`"),
    (["--stages", "1", "--scale-interval-s", "1"], "--scale-interval-s: only means something with --max-instances"),
    (["--stages", "1", "--max-instances", "2", "--scale-interval-s", "0"], "--scale-interval-s: expected"),
    (["--stages", "1", "--max-instances", "2", "--scale-dwell-s", "60"], "--scale-dwell-s: .*never given back"),
    (["--stages", "1", "--scale-outage-hold-s", "0"], "--scale-outage-hold-s: only means something with --max-"),
    (["--stages", "1", "--max-instances", "2", "--scale-outage-hold-s", "-1"], "--scale-outage-hold-s: expected"),
    (["--stages", "1", "--max-instances", "2", "--scale-outage-hold-s", "86401"],
     "--scale-outage-hold-s: expected a finite number >= 0 and <= 86400 \\(s\\), got 86401"),
    (["--stages", "1", "--instances", "2", "--inline-control"], "--instances: several instances and --inline-control"),
    (["--stages", "1", "--instances", "2", "--ray", "127.0.0.1:1"], "--instances: several instances and --ray"),
])
def test_unclear_or_bad_instance_flags_are_refused_before_a_model_loads(argv, message, monkeypatch):
    import flexpipe_dag.runtime.model_loader as model_loader

    def no_load(*_a, **_k):
        raise AssertionError("the checkpoint was read before the flags were checked")

    monkeypatch.setattr(model_loader, "resolve_checkpoint", no_load)
    args = _serve_args(*argv, *(["--no-store"] if "--inline-control" not in argv else []))
    with pytest.raises(InputError, match=message):
        args.func(args)


def test_a_stages_gear_and_a_gear_without_an_envelope_are_refused_in_the_same_words(monkeypatch):
    """The early refusal of a --stages gear (before the checkpoint is read) copied replicated_plan's wording;
    both now say no_envelope_problem, after the gear's id, on --max-instances."""
    import flexpipe_dag.runtime.model_loader as model_loader
    from flexpipe_dag.planner.fleet import no_envelope_problem
    from flexpipe_dag.serving.frontdoor.server import InstanceSettings
    from tests.support import enveloped_gear

    def no_load(*_a, **_k):
        raise AssertionError("the checkpoint was read before the flags were checked")

    monkeypatch.setattr(model_loader, "resolve_checkpoint", no_load)
    args = _serve_args("--stages", "2", "--max-instances", "2", "--no-store")
    with pytest.raises(InputError) as stages:
        args.func(args)
    gear = enveloped_gear("g", "latency", 0.0, 0.0, 1)
    with pytest.raises(InputError) as unmeasured:
        InstanceSettings(max_instances=2).check(gear)
    assert (stages.value.field, unmeasured.value.field) == ("--max-instances", "--max-instances")
    assert stages.value.problem == f"gear uniform-2: {no_envelope_problem(None)}"
    assert unmeasured.value.problem == f"gear g: {no_envelope_problem(0.0)}"


def test_a_replicated_plan_needs_the_gears_envelope():
    from flexpipe_dag.planner.fleet import replicated_plan
    from tests.support import enveloped_gear

    gear = enveloped_gear("g", "latency", 0.0, 0.5, 1)
    plan = replicated_plan(gear, 3)
    assert [i.instance_id for i in plan.instances] == ["g-0", "g-1", "g-2"]
    assert plan.rps_max == pytest.approx(1.5) and plan.instances_for(0.9) == 2
    for rps_max in (0.0, float("inf")):
        with pytest.raises(InputError, match="no measured envelope"):
            replicated_plan(gear.model_copy(update={"rps_max": rps_max}), 2)
    with pytest.raises(InputError, match="num_instances"):
        replicated_plan(gear, 0)


@pytest.mark.slow
def test_the_fleet_scaler_scales_out_under_load_and_every_request_is_answered_once(tmp_path):
    from flexpipe_dag.core.gear_builders import even_gear

    hf_reference()
    ckpt = checkpoint()
    gear = even_gear(ckpt.num_layers, 1, ckpt.name, 8, None, 4096).model_copy(update={"rps_max": 0.05})
    path = tmp_path / "tiny-envelope.json"
    path.write_text(gear.model_dump_json())
    srv = Server("--gear", str(path), "--no-store", "--max-instances", "2", "--scale-interval-s", "0.5",
                 "--port", "0", env={"FLEXPIPE_HOME": str(tmp_path)})
    results: list[tuple[int, str, int]] = []
    stop = threading.Event()

    def clients(worker: int) -> None:  # closed loop: the next request once the last is answered
        i = worker
        while not stop.is_set():
            results.append(_greedy(client, i))
            i += 4

    try:
        url = srv.wait_bound(START_TIMEOUT_S)
        assert httpx.get(url + "/health").json()["instances"] == 1
        client = _client(url)
        with ThreadPoolExecutor(4) as pool:
            load = [pool.submit(clients, w) for w in range(4)]
            try:  # ~1 req/s against an envelope of 0.05: the scaler's first sample overloads
                wait_until(lambda: _metrics(url)[("flexpipe_instance_changes_total", "out")] == 1, START_TIMEOUT_S,
                           "the scaler to add an instance")
                assert len(_instances(url)) == 2
                wait_until(lambda: min(s["requests_finished"] for s in _instances(url)) >= 1, START_TIMEOUT_S,
                           "the added instance to finish a request")
            finally:
                stop.set()
            for f in load:
                f.result()
        _check_exact(results)
        status = _instances(url)
        assert sum(s["requests_finished"] for s in status) == len(results), status  # each answered once
        metrics = _metrics(url)
        assert metrics[("flexpipe_e2e_request_latency_seconds_count", "online")] == len(results)
        assert metrics[("flexpipe_instance_changes_total", "out")] == 1
        assert metrics[("flexpipe_instance_changes_total", "in")] == 0  # the dwell (600 s) holds both
        assert metrics[("flexpipe_instances", "")] == 2
    finally:
        stop.set()
        assert srv.stop() == 0
    log = "\n".join(srv.lines)
    assert "fleet scaler: 1..2 instances of 0.05 req/s" in log and "scale out 1 -> 2" in log, log[-3000:]


#: A server whose second instance cannot start: worker0 is given memory for one instance only.
ONE_FITS_SERVER = """
import sys
from flexpipe_dag.core.gear_builders import even_gear
from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, stage_memory_bytes
from flexpipe_dag.serving.frontdoor.server import FrontDoorServer, InstanceSettings, ServerSettings
from tests.test_runtime_helpers import checkpoint
ckpt = checkpoint()
gear = even_gear(ckpt.num_layers, 1, ckpt.name, 8, None, 4096)
one = stage_memory_bytes(gear, ckpt)[0]["total_bytes"]
runtime = PipelineRuntime(gear, ckpt, RuntimeOptions(stream_tokens=True, device_memory_bytes={"worker0": int(1.5 * one)}))
server = FrontDoorServer(runtime, ckpt.tokenizer(), ckpt.eos_token_ids(), 8192,
                         ServerSettings(port=0, model_name=ckpt.name), instances=InstanceSettings(instances=2))
sys.exit(server.run())
"""


@pytest.mark.slow
def test_an_extra_instance_that_cannot_start_stops_the_server_with_the_reason(tmp_path):
    checkpoint()
    srv = Server(env={"FLEXPIPE_HOME": str(tmp_path)}, command=[sys.executable, "-c", ONE_FITS_SERVER])
    assert srv.proc.wait(timeout=START_TIMEOUT_S) == 1
    srv.stop()
    log = "\n".join(srv.lines)
    assert "startup failed: gear 'uniform-1' does not fit beside the live instances" in log, log[-3000:]
    assert "Traceback" not in log and "Application startup failed" not in log  # the reason, in one line
    assert srv.url is None  # never bound


def test_a_server_of_several_instances_fails_the_gear_shifts_asked_of_it(store):
    """A `gear_shift` run's request would move the entry point only: it is failed with the reason, never applied."""
    from types import SimpleNamespace

    from flexpipe_dag.serving.live_control import LiveControl

    event = store.record_shift_event("shift", "decided", "r", from_gear_key="uniform-1", to_gear_key="uniform-2",
                                     run_key="serve-1", decision_key="k")
    store.request_shift(event, "serve-1", 60)
    router = SimpleNamespace(active=SimpleNamespace(gear=SimpleNamespace(gear_id="uniform-1")))
    live = LiveControl(store, None, router, None, (), "serve-1", inline_control=False, log=lambda line: None,
                       shifts_refused="this server runs several instances of its gear")
    live.step()
    ev = store.get_shift_event(event)
    assert (ev.status, ev.details["error"]) == ("failed", "this server runs several instances of its gear")
    assert live.shift_thread is None and [s["status"] for s in live.shifts] == ["failed"]


#: A server of two instances of a gear with a large envelope whose scaler gives one back at its first sample (3 s
#: after startup: while the test's first requests run), the payback test passed by a 1-s dwell over no cost.
SCALE_IN_SERVER = """
import sys
from flexpipe_dag.control.fleet_scaler import FleetScalerConfig
from flexpipe_dag.core.gear_builders import even_gear
from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
from flexpipe_dag.serving.frontdoor.server import FrontDoorServer, InstanceSettings, ServerSettings
from tests.test_runtime_helpers import checkpoint
ckpt = checkpoint()
gear = even_gear(ckpt.num_layers, 1, ckpt.name, 8, None, 4096).model_copy(update={"rps_max": 100.0})
quick = FleetScalerConfig(sample_period_s=3.0, hysteresis_samples=1, dwell_s=1.0, forecast_horizon_s=0.0,
                          instance_warmup_s=0.0, instance_drain_s=0.0, payback_factor=0.0,
                          outage_hold_s=0.0)  # the load ends: no outage hold, give an instance back
server = FrontDoorServer(PipelineRuntime(gear, ckpt, RuntimeOptions(stream_tokens=True)), ckpt.tokenizer(),
                         ckpt.eos_token_ids(), 8192, ServerSettings(port=0, model_name=ckpt.name),
                         instances=InstanceSettings(instances=2, max_instances=2, scaler=quick))
sys.exit(server.run())
"""


@pytest.mark.slow
def test_the_fleet_scaler_gives_an_instance_back_and_what_it_held_is_answered_once(tmp_path):
    hf_reference()
    checkpoint()
    srv = Server(env={"FLEXPIPE_HOME": str(tmp_path)}, command=[sys.executable, "-c", SCALE_IN_SERVER])
    try:
        url = srv.wait_bound(START_TIMEOUT_S)
        client = _client(url)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: _greedy(client, i), range(16)))
        wait_until(lambda: _metrics(url)[("flexpipe_instance_changes_total", "in")] == 1, 60.0,
                   "the scaler to give an instance back (withdrawn, drained, shut down)")
        assert httpx.get(url + "/health").json()["instances"] == 1
        results += [_greedy(client, i) for i in range(2)]  # the one left serves on
        _check_exact(results)
        metrics = _metrics(url)
        assert metrics[("flexpipe_instance_changes_total", "out")] == 0
        assert metrics[("flexpipe_e2e_request_latency_seconds_count", "online")] == len(results)  # each once
        assert [s["instance_id"] for s in _instances(url)] == ["uniform-1#1"]  # the entry point stays
        assert {pipeline for pipeline, _ in _pipeline_series(url)} == {"uniform-1#1"}  # the gone one's series went
    finally:
        assert srv.stop() == 0
    log = "\n".join(srv.lines)
    assert "scale in 2 -> 1" in log, log[-3000:]
