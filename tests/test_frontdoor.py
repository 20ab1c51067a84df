"""The front door (`flexpipe serve`) driven by the official `openai` SDK and raw HTTP, on the real
two-stage SmolLM2 pipeline: outputs equal transformers' greedy `generate`, streaming, stop sequences,
usage, OpenAI error shapes, metrics that match what the clients saw, a drain that finishes open work."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flexpipe_dag.serving.frontdoor.process import ServerProcess
from tests.support import MODEL_CACHE, REPO, wait_until
from tests.test_runtime_helpers import MAX_NEW_TOKENS, PROMPTS, checkpoint, hf_reference, prompt_ids

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
#: Prompts SmolLM2 answers at length (greedy), so streams stay open across a shift.
LONG_PROMPTS = ["Count: 1, 2, 3, 4,", "Write a long story about a dragon who learns to fly.",
                "List the numbers from 10 to 100 in words:"]


class Server(ServerProcess):
    """A `flexpipe serve` process run from this checkout; its stderr lines are kept in :attr:`lines`."""

    def __init__(self, *args: str, env: dict | None = None, command: list[str] | None = None, new_session: bool = False):
        super().__init__(args, env={"FLEXPIPE_MODEL_CACHE": MODEL_CACHE, "PYTHONPATH": str(REPO), **(env or {})},
                         cwd=REPO, command=command, new_session=new_session)

    def wait_bound(self, timeout_s: float = 240.0) -> str:
        """``http://HOST:PORT`` (no ``/v1``)."""
        return super().wait_bound(timeout_s).removesuffix("/v1")

    def stop(self, timeout_s: float = 120.0) -> int:
        return super().stop(timeout_s)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint()  # converted once into the shared cache before the server reads it
    home = tmp_path_factory.mktemp("serve-home")
    srv = Server("--stages", "2", "--port", "0", "--max-pending", "64", env={"FLEXPIPE_HOME": str(home)})
    srv.url = srv.wait_bound()
    srv.home = home
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _tokens(text: str) -> list[int]:
    return list(checkpoint().tokenizer()(text, add_special_tokens=False)["input_ids"])


def test_models_health_and_ready(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "instances": 1}
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["gear_id"] == "uniform-2"


def test_greedy_output_through_the_endpoint_equals_transformers_generate(client):
    ref = hf_reference()
    tok = checkpoint().tokenizer()
    for i in (0, 3):  # token-id prompts (the chat-templated ids the reference used) and chat messages
        ids = list(prompt_ids()[i])
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_NEW_TOKENS, temperature=0)
        assert out.choices[0].text == tok.decode(ref[str(i)], skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref[str(i)])
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}],
                                              max_tokens=MAX_NEW_TOKENS, temperature=0)
        assert chat.choices[0].message.content == out.choices[0].text  # the template applied server-side
        assert chat.usage.prompt_tokens == len(ids)


def test_a_chat_question_gets_an_answer_and_usage_counts_the_tokens(client):
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    answer = chat.choices[0].message.content
    assert "Paris" in answer and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert chat.usage.completion_tokens >= len(_tokens(answer))  # + the end-of-sequence token when it stopped


def test_streaming_sends_the_same_text_piece_by_piece_then_usage(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 3  # token by token, not one blob
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_pipelines_own_timings_come_with_the_last_chunk_and_the_response(client):
    kwargs = dict(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0)
    sent = time.monotonic()
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    ended = time.monotonic()
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert [c for c in chunks if c.model_extra.get("pipeline_timings")] == [last]  # on the finish chunk only
    t = last.model_extra["pipeline_timings"]
    assert 0 < t["ttft_ms"] <= t["e2e_ms"] <= 1e3 * (ended - sent)
    tokens = chunks[-1].usage.completion_tokens
    assert t["tpot_ms"] == pytest.approx((t["e2e_ms"] - t["ttft_ms"]) / (tokens - 1), abs=0.01)
    whole = client.completions.create(**kwargs)
    w = whole.model_extra["pipeline_timings"]
    assert 0 < w["ttft_ms"] <= w["e2e_ms"] and w["tpot_ms"] > 0
    one = client.completions.create(**{**kwargs, "max_tokens": 1}).model_extra["pipeline_timings"]
    assert one["tpot_ms"] is None and 0 < one["ttft_ms"] <= one["e2e_ms"]  # the result comes after the token
    cut = client.completions.create(**kwargs, stop=["6"])  # ends at the token that completes the stop
    c, k = cut.model_extra["pipeline_timings"], cut.usage.completion_tokens
    assert cut.choices[0].finish_reason == "stop" and 1 < k < 12
    assert 0 < c["ttft_ms"] < c["e2e_ms"] < w["e2e_ms"]
    assert c["tpot_ms"] == pytest.approx((c["e2e_ms"] - c["ttft_ms"]) / (k - 1), abs=0.01)


def test_a_stop_sequence_ends_the_text_before_it(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert "6" in text, text  # the model counts on
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0,
                                    stop=["6"])
    assert cut.choices[0].text == text[:text.index("6")] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0, stop=["6"], stream=True))
    assert streamed == cut.choices[0].text
    # stops longer than the text before them (held text must not leak), at the very start, mid-word
    for stop in (text[:len(text) // 2], text[2:len(text) - 1], text[len(text) // 3:len(text) // 3 + 3]):
        start = text.index(stop)
        kwargs = dict(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
        whole = client.completions.create(**kwargs)
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (text[:start], "stop"), stop
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:start], stop
        assert 1 <= whole.usage.completion_tokens == chunks[-1].usage.completion_tokens <= 12


def test_a_client_that_goes_away_and_a_stop_sequence_cancel_the_request_in_the_pipeline(server, client):
    """The pipeline's side (the request ends within a step, its KV blocks freed) is
    tests/test_runtime_pipeline.py's; here: the server cancels exactly those requests and serves on."""
    def cancelled() -> float:
        return _metrics(server.url)[("flexpipe_requests_cancelled_total", "online")]

    start = cancelled()
    prompt_tokens = _metrics(server.url)[("flexpipe_prompt_tokens_total", "online")]
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3, 4,", "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # the client goes away with 1,500 tokens to come
    wait_until(lambda: cancelled() == start + 1, 10.0, "the server to cancel the abandoned request")
    # its prompt was processed: counted with the tokens sampled before the client left (the pipeline's work)
    assert _metrics(server.url)[("flexpipe_prompt_tokens_total", "online")] == \
        prompt_tokens + len(checkpoint().tokenizer().encode("Count: 1, 2, 3, 4,"))
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=40, temperature=0, stop=["6"])
    assert cut.choices[0].finish_reason == "stop" and cancelled() == start + 2  # ended at the stop, not at 40
    whole = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=4, temperature=0)
    assert whole.choices[0].finish_reason == "length" and cancelled() == start + 2  # a finished one is not
    assert _metrics(server.url)[("flexpipe_requests_running", "online")] == 0
    # not streamed: a client that times out and leaves cancels it too (it held a seat and KV blocks for 1,500
    # tokens: four of them once filled --max-pending and every client got 429 for 15 minutes)
    def aborted() -> float:
        return sum(s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
                   for s in f.samples if s.name == "flexpipe_requests_total"
                   and s.labels == {"endpoint": "completions", "outcome": "aborted"})

    aborted_before = aborted()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    wait_until(lambda: cancelled() == start + 3, 10.0, "the server to cancel the abandoned non-streamed request")
    wait_until(lambda: _metrics(server.url)[("flexpipe_requests_running", "online")] == 0, 10.0,
               "the abandoned request to leave the running gauge")
    assert aborted() == aborted_before + 1


def test_tokens_through_stop_counts_to_the_token_that_completes_the_stop():
    from flexpipe_dag.serving.frontdoor.engine import tokens_through_stop

    tok = checkpoint().tokenizer()
    ids = tok.encode(" one two three four five", add_special_tokens=False)
    for k in range(1, len(ids) + 1):
        tail = tok.decode(ids[:k]).split()[-1]
        assert tokens_through_stop(tok, ids, (tail,)) <= k
    assert tokens_through_stop(tok, ids, (" three",)) == len(tok.encode(" one two three", add_special_tokens=False))
    assert tokens_through_stop(tok, ids, ("six",)) == len(ids)


def test_bad_requests_get_openai_errors_naming_the_field(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=8)
    assert err.value.code == "context_length_exceeded" and "maximum context length is 8192 tokens" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:  # no silent cut: prompt + max_tokens must fit
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8190)
    assert err.value.code == "context_length_exceeded" and "8193 tokens" in str(err.value)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=3)
    assert err.value.body["param"] == "temperature"
    bad_json = httpx.post(server.url + "/v1/completions", content=b'{"model": "x", "prompt": ',
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    bad_header = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            headers={"X-FlexPipe-Priority": "urgent"})
    assert bad_header.status_code == 400 and bad_header.json()["error"]["param"] == "X-FlexPipe-Priority"


def test_hostile_bodies_get_openai_errors_and_the_server_keeps_serving(server, client):
    url = server.url + "/v1/completions"
    head = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as http:  # one keep-alive connection: an error must not drop it
        lone = http.post(url, content=b'{"model": "%s", "prompt": "\\ud800 x", "max_tokens": 2}' % MODEL.encode(),
                         headers=head)
        assert lone.status_code == 400 and lone.json()["error"]["param"] == "prompt"
        lone = http.post(server.url + "/v1/chat/completions", headers=head,
                         content=b'{"model": "\\ud800", "messages": [{"role": "user", "content": "a"}]}')
        assert lone.status_code == 400 and lone.json()["error"]["param"] == "model"
        coerced = http.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": "2"})
        assert coerced.status_code == 400 and coerced.json()["error"]["param"] == "max_tokens"
        big = http.post(url, content=b'{"model": "x", "prompt": "' + b"a" * (9 * 2**20) + b'"}', headers=head)
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: cut off once the bytes pass the limit
        yield b'{"model": "x", "prompt": "'
        for _ in range(20):
            yield b"a" * 2**20

    chunked = httpx.post(url, content=chunks(), headers=head, timeout=60)
    assert chunked.status_code == 413
    for i in range(3):  # paths nobody serves share one label: clients cannot mint metric series
        assert httpx.get(f"{server.url}/nothing-{i}").status_code == 404
    labels = {(s.labels["endpoint"], s.labels["outcome"]) for f in text_string_to_metric_families(
        httpx.get(server.url + "/metrics").text) if f.name == "flexpipe_requests" for s in f.samples}
    assert {e for e, _ in labels} <= {"completions", "chat_completions", "models", "files", "batches", "batch",
                                      "health", "ready", "metrics", "other"}
    assert ("other", "error_404") in labels and ("completions", "error_413") in labels
    ok = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_concurrent_streams_each_complete_once_and_metrics_match_what_clients_saw(server, client):
    before = _metrics(server.url)

    def one(i: int) -> tuple[str, int, str]:
        kwargs = dict(model=MODEL, max_tokens=6 + i % 5, temperature=0.8, seed=i,
                      extra_headers={"X-FlexPipe-Priority": "offline"} if i % 4 == 0 else None)
        stream = client.completions.create(prompt=PROMPTS[i % len(PROMPTS)], stream=True,
                                           stream_options={"include_usage": True}, **kwargs)
        chunks = list(stream)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishes) == 1  # each stream ends exactly once
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens, finishes[0]

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    assert all(n >= 1 for _, n, _ in results)
    after = _metrics(server.url)
    sent = sum(n for _, n, _ in results)
    got = sum(after[("flexpipe_generation_tokens_total", c)] - before[("flexpipe_generation_tokens_total", c)]
              for c in ("online", "offline"))
    assert got == sent  # every token a client received, counted once
    assert after[("flexpipe_generation_tokens_total", "offline")] > before[("flexpipe_generation_tokens_total", "offline")]
    ttft = after[("flexpipe_time_to_first_token_seconds_count", "online")] + \
        after[("flexpipe_time_to_first_token_seconds_count", "offline")]
    assert ttft - (before[("flexpipe_time_to_first_token_seconds_count", "online")]
                   + before[("flexpipe_time_to_first_token_seconds_count", "offline")]) == 24
    assert after[("flexpipe_requests_running", "online")] == 0 and after[("flexpipe_live_gear_info", "uniform-2")] == 1



#: AIPerf, NVIDIA's LLM benchmarking client, in a venv of its own (its dependencies are not the product's).
AIPERF_VERSION = "0.13.0"
AIPERF_VENV = Path(MODEL_CACHE).parent / f"aiperf-{AIPERF_VERSION}"


def _aiperf() -> Path:
    """The ``aiperf`` executable, installed from the package index once per machine (skips with the pip
    error when it cannot be installed here: no index, or no wheel for this Python)."""
    exe, done = AIPERF_VENV / "bin" / "aiperf", AIPERF_VENV / ".installed"
    if done.exists():
        return exe
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(AIPERF_VENV)], check=True)  # a half install too
    pip = subprocess.run([str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "-q", f"aiperf=={AIPERF_VERSION}"],
                         capture_output=True, text=True, timeout=900)
    if pip.returncode != 0:
        pytest.skip(f"aiperf=={AIPERF_VERSION} does not install on this host: {pip.stderr.strip()[-300:]}")
    done.touch()
    return exe


@pytest.mark.timeout(1800)  # the first run on a machine installs AIPerf (about 3 minutes)
def test_aiperf_profiles_the_server_and_its_counts_match_the_servers_metrics(server, tmp_path):
    aiperf = _aiperf()
    before = _metrics(server.url)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # AIPerf's offline mode looks a tokenizer up in the hub's cache only; online, a local directory loads as is
    out = subprocess.run([str(aiperf), "profile", "--model", MODEL, "--url", server.url, "--endpoint-type", "chat",
                          "--streaming", "--tokenizer", str(checkpoint().path), "--request-count", "6",
                          "--concurrency", "2", "--prompt-input-tokens-mean", "32", "--prompt-input-tokens-stddev", "0",
                          "--prompt-output-tokens-mean", "12", "--prompt-output-tokens-stddev", "0", "--random-seed",
                          "1", "--ui-type", "none", "--no-gpu-telemetry", "--use-server-token-count",
                          "--output-artifact-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 6 and not report.get("error_summary")
    assert report["time_to_first_token"]["count"] == 6 and report["time_to_first_token"]["min"] > 0
    after = _metrics(server.url)

    def grew(name: str) -> float:
        return after[(name, "online")] - before.get((name, "online"), 0.0)

    # the usage counts AIPerf read from the streams are what the server counted, token for token
    assert grew("flexpipe_generation_tokens_total") == report["usage_completion_tokens"]["sum"]
    assert grew("flexpipe_prompt_tokens_total") == report["usage_prompt_tokens"]["sum"]
    assert grew("flexpipe_time_to_first_token_seconds_count") == 6


def _metrics(url: str) -> dict[tuple[str, str], float]:
    """``(sample name, its priority_class / gear_id / direction label) -> value`` from ``GET /metrics``."""
    text = httpx.get(url + "/metrics").text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):  # parses, or raises
        for s in family.samples:
            label = s.labels.get("priority_class") or s.labels.get("gear_id") or s.labels.get("direction") or ""
            out[(s.name, label)] = out.get((s.name, label), 0.0) + s.value
    return out


def _pipeline_series(url: str, name: str = "flexpipe_kv_blocks_free") -> dict[tuple[str, str], float]:
    """``(pipeline, stage) -> value`` of one per-pipeline gauge from ``GET /metrics``."""
    text = httpx.get(url + "/metrics").text
    return {(s.labels["pipeline"], s.labels["stage"]): s.value for f in text_string_to_metric_families(text)
            if f.name == name for s in f.samples}


def test_an_api_key_is_required_when_set_and_other_hosts_need_one(tmp_path):
    from fastapi.testclient import TestClient

    from flexpipe_dag.serving.frontdoor.app import create_app
    from flexpipe_dag.serving.frontdoor.engine import FrontDoorEngine
    from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics

    engine = FrontDoorEngine(checkpoint().tokenizer(), (2,), 8192, FrontDoorMetrics())  # no pipeline attached
    http = TestClient(create_app(engine, MODEL, api_key="s3cret"))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = http.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/models").status_code == 401
    r = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"  # past the key: no pipeline yet
    assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 503
    # binding beyond loopback without a key is refused before any model loads
    cli = subprocess.run([sys.executable, "-m", "flexpipe_dag.cli", "serve", "--stages", "1", "--host", "0.0.0.0"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "--api-key-file" in cli.stderr and len(cli.stderr.strip().splitlines()) == 1
    empty = tmp_path / "key"
    empty.write_text("\n")
    cli = subprocess.run([sys.executable, "-m", "flexpipe_dag.cli", "serve", "--stages", "1", "--api-key-file",
                          str(empty)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and str(empty) in cli.stderr and "empty" in cli.stderr


@pytest.mark.parametrize("to_group", [False, True], ids=["main-pid", "process-group"])
def test_sigterm_drains_open_requests_then_stops(tmp_path, to_group):
    """SIGTERM to the server's pid, and to its whole process group (systemd's default stop, ``kill -TERM -- -PGID``:
    the stage workers got it too, died, and the open stream ended with "driver failed" instead of draining)."""
    srv = Server("--stages", "1", "--port", "0", "--drain-timeout-s", "60", env={"FLEXPIPE_HOME": str(tmp_path)},
                 new_session=to_group)
    url = srv.wait_bound()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.completions.create, model=MODEL, prompt="Once upon a time", max_tokens=48,
                              temperature=0)
        time.sleep(1.0)
        if to_group:  # while the request is open
            os.killpg(srv.proc.pid, signal.SIGTERM)
        else:
            srv.proc.send_signal(signal.SIGTERM)
        out = pending.result(timeout=120)
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
    assert srv.proc.wait(timeout=120) == 0  # its own status: uvicorn does not re-raise the signal and kill it
    assert srv.stop() == 0
    lock = tmp_path / "pipeline_runtime.lock"
    assert lock.exists() and not lock.with_name(lock.name + ".holder").exists()  # released, nobody named as holder
    assert any("draining done (0 request(s) cut off)" in line for line in srv.lines), "\n".join(srv.lines)


def test_a_gear_shift_under_24_open_streams_loses_and_repeats_nothing(tmp_path):
    """The store-driven path users run: the server registers as a serving run, a `gear_shift` run asks it
    to move from 2 stages to 1 while 24 streams are open; every stream ends once, with the same text a
    request served after the shift gets (greedy: the partition does not change the output)."""
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.core.gear_builders import even_gear
    from flexpipe_dag.jobs.gear_shift import gear_shift
    from flexpipe_dag.resources.store_resource import StoreResource
    from flexpipe_dag.sql.store import Store
    from tests.support import EXAMPLES

    url = f"sqlite:///{tmp_path / 'flexpipe.db'}"
    db = Store.from_url(url)
    info = db.save_profile(load_cluster_profile(EXAMPLES / "seed_example.yaml"))
    target = even_gear(30, 1, MODEL, 8, None, 8192)
    db.save_gears([target], info.id, db.save_model(MODEL, "fp32", 30, {"layers": 30}))
    srv = Server("--stages", "2", "--port", "0", "--run-key", "fd-shift-test",
                 env={"FLEXPIPE_HOME": str(tmp_path), "FLEXPIPE_DATABASE_URL": url})
    try:
        url_http = srv.wait_bound()
        client = openai.OpenAI(base_url=url_http + "/v1", api_key="unused", max_retries=0, timeout=300)
        deadline = time.monotonic() + 60
        while db.pipeline_liveness("fd-shift-test").gear_key != "uniform-2" and time.monotonic() < deadline:
            time.sleep(0.5)  # registered by its first control step

        def one(i: int) -> tuple[str, str, int]:
            stream = client.completions.create(model=MODEL, prompt=LONG_PROMPTS[i % 3], max_tokens=64,
                                               temperature=0, stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert len(finishes) == 1
            ended_s.append(time.time())
            return "".join(c.choices[0].text for c in chunks if c.choices), finishes[0], chunks[-1].usage.completion_tokens

        ended_s: list[float] = []
        with ThreadPoolExecutor(24) as pool:
            streams = [pool.submit(one, i) for i in range(24)]
            time.sleep(2.0)  # the streams are open
            requested_s = time.time()
            result = gear_shift.execute_in_process(
                run_config={"ops": {"apply_gear_shift": {"config": {"to_gear_id": "uniform-1",
                                                                    "run_key": "fd-shift-test", "timeout_s": 300}}}},
                resources={"store": StoreResource(database_url=url)})
            done = [f.result(timeout=300) for f in streams]
        assert result.success
        (ev,) = db.shift_events()
        assert ev.status == "done" and ev.to_gear_key == "uniform-1", ev.details
        switch_after_s = ev.details["timings_s"]["warmup"]  # the switch comes after pickup and warm-up
        open_at_switch = [t for t in ended_s if t > requested_s + switch_after_s]
        assert len(open_at_switch) >= 8, (sorted(round(t - requested_s, 1) for t in ended_s), ev.details)
        ready = httpx.get(url_http + "/ready").json()
        assert ready["gear_id"] == "uniform-1"
        after = [client.completions.create(model=MODEL, prompt=p, max_tokens=64, temperature=0) for p in LONG_PROMPTS]
        for i, (text, finish, n) in enumerate(done):  # nothing lost, nothing repeated: the text served after
            ref = after[i % 3]
            assert (text, finish, n) == (ref.choices[0].text, ref.choices[0].finish_reason,
                                         ref.usage.completion_tokens), i
        metrics = _metrics(url_http)
        assert metrics[("flexpipe_gear_shifts_total", "")] == 1 and metrics[("flexpipe_live_gear_info", "uniform-1")] == 1
    finally:
        srv.stop()
    assert db.pipeline_liveness("fd-shift-test").why_not_live(time.time(), math.inf) is not None  # ended


# -- the Batch API ---------------------------------------------------------------------------------------
def _chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
                     "max_tokens": 8, **body}}


def _upload(client, lines: list[dict]):
    payload = "\n".join(json.dumps(line) for line in lines).encode()
    return client.files.create(file=("batch.jsonl", payload), purpose="batch")


def _wait_batch(client, batch_id: str, until: tuple[str, ...], timeout_s: float = 240.0, at_least: int = 0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until and batch.request_counts.completed >= at_least:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)


def _jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def test_a_batch_round_trip_through_the_openai_sdk(client):
    lines = [_chat_line(f"q-{i}", PROMPTS[i]) for i in range(4)]
    lines.insert(2, {**_chat_line("wrong-model", "hi"), "body": {**_chat_line("x", "hi")["body"], "model": "gpt-4o"}})
    lines.append(_chat_line("too-long", "hi", max_tokens=9000))
    upload = _upload(client, lines)
    assert client.files.retrieve(upload.id).bytes == upload.bytes > 0
    listed = client.files.list()  # newest first: the upload just made leads
    assert listed.data[0].id == upload.id and listed.data[0].bytes == upload.bytes
    assert [f.id for f in client.files.list(purpose="batch").data][0] == upload.id
    assert client.files.list(purpose="fine-tune").data == []
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"team": "search"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 6
    done = _wait_batch(client, batch.id, ("completed",))
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 2) and done.metadata == {"team": "search"}
    out = _jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["q-0", "q-1", "q-2", "q-3"]  # input order, one line each
    for o, i in zip(out, range(4)):
        direct = client.chat.completions.create(**_chat_line("", PROMPTS[i])["body"])
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert o["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert o["response"]["body"]["usage"] == direct.usage.model_dump(exclude_none=True)
    errors = {e["custom_id"]: e for e in _jsonl(client, done.error_file_id)}
    assert errors["wrong-model"]["response"]["status_code"] == 404
    assert errors["too-long"]["error"]["code"] == "context_length_exceeded"


def test_a_batch_line_with_a_stop_sequence_answers_as_the_endpoint_and_is_cancelled_at_the_stop(server, client):
    """The line's body is the endpoint's answer for it (text cut before the stop, ``finish_reason`` stop, usage
    through the token that completed it), and its generation is cancelled there, not run to ``max_tokens``."""
    free = client.chat.completions.create(**_chat_line("", LONG_PROMPTS[1], max_tokens=48)["body"])
    text = free.choices[0].message.content
    assert free.usage.completion_tokens == 48 and len(text) > 40, text
    stop = text[len(text) // 3:len(text) // 3 + 4]  # its first occurrence ends well before the 48th token
    body = _chat_line("", LONG_PROMPTS[1], max_tokens=48, stop=[stop])["body"]
    direct = client.chat.completions.create(**body)
    assert direct.choices[0].finish_reason == "stop" and direct.usage.completion_tokens < 40, (stop, direct)
    before = _metrics(server.url)
    batch = client.batches.create(input_file_id=_upload(client, [{**_chat_line("s", ""), "body": body}]).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = _wait_batch(client, batch.id, ("completed",))
    [line] = _jsonl(client, done.output_file_id)
    got = line["response"]["body"]
    assert got["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"] == direct.usage.model_dump(exclude_none=True)
    key = ("flexpipe_requests_cancelled_total", "offline")
    wait_until(lambda: _metrics(server.url)[key] == before[key] + 1, 10.0, "the line's generation cancelled")


def test_a_bad_batch_file_is_refused_naming_the_line_and_nothing_is_stored(server, client):
    good = _chat_line("a", "hi")
    for bad, needle in (([good, good], "line 2: custom_id 'a' is repeated"),
                        ([good, {**good, "custom_id": "b", "url": "/v1/completions"}], "line 2: url: expected"),
                        ([good, {**good, "custom_id": "c", "body": "text"}], "line 2: body: expected a JSON object")):
        upload = _upload(client, bad)
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert needle in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    from flexpipe_dag.sql.store import Store

    jobs = Store.from_url(f"sqlite:///{server.home / 'flexpipe.db'}").jobs(kind="batch")
    assert all(j.total_requests != 2 for j in jobs)  # none of the refused two-line files became a batch


def test_cancel_mid_batch_keeps_what_finished_then_a_new_batch_runs(server, client):
    upload = _upload(client, [_chat_line(f"c-{i}", PROMPTS[i % len(PROMPTS)], max_tokens=24) for i in range(40)])
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    _wait_batch(client, batch.id, ("in_progress",), at_least=1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    cancelled = _wait_batch(client, batch.id, ("cancelled",))
    kept = cancelled.request_counts.completed
    assert 1 <= kept < 40
    assert len(_jsonl(client, cancelled.output_file_id)) == kept
    wait_until(lambda: any(f"batch {batch.id}: cancelled (" in line for line in server.lines), 10.0,
               "the server to log the cancel")
    time.sleep(2.0)
    assert client.batches.retrieve(batch.id).request_counts.completed == kept  # nothing more was submitted
    again = client.batches.create(input_file_id=_upload(client, [_chat_line("n-0", "hi")]).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert _wait_batch(client, again.id, ("completed",)).request_counts.completed == 1


def test_a_server_restarted_mid_batch_loses_nothing_and_repeats_nothing(tmp_path):
    env = {"FLEXPIPE_HOME": str(tmp_path)}
    first = Server("--stages", "1", "--port", "0", "--batch-inflight", "1", env=env)
    try:
        client = openai.OpenAI(base_url=first.wait_bound() + "/v1", api_key="unused", max_retries=0, timeout=120)
        upload = _upload(client, [_chat_line(f"r-{i}", PROMPTS[i % len(PROMPTS)], max_tokens=16) for i in range(24)])
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        mid = _wait_batch(client, batch.id, ("in_progress", "completed"), at_least=2)
        assert mid.status == "in_progress" and mid.request_counts.completed < 24, mid  # stopped mid-batch
    finally:
        first.stop()
    second = Server("--stages", "2", "--port", "0", env=env)
    try:
        client = openai.OpenAI(base_url=second.wait_bound() + "/v1", api_key="unused", max_retries=0, timeout=120)
        done = _wait_batch(client, batch.id, ("completed",))
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (24, 24, 0)
        out = _jsonl(client, done.output_file_id)
        assert [o["custom_id"] for o in out] == [f"r-{i}" for i in range(24)]
    finally:
        second.stop()


def test_loadtest_replays_a_trace_and_sweeps_concurrency_against_the_server(server, tmp_path):
    out, png = tmp_path / "lt.json", tmp_path / "lt.png"
    cli = subprocess.run([sys.executable, "-m", "flexpipe_dag.cli", "loadtest", "--url", server.url + "/v1",
                          "--trace", "azure-conv", "--requests", "8", "--speedup", "20", "--concurrency", "1,4",
                          "--max-prompt-tokens", "48", "--max-tokens", "6", "--out", str(out), "--plot", str(png)],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FLEXPIPE_MODEL_CACHE": MODEL_CACHE})
    assert cli.returncode == 0, cli.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["model"] == MODEL and report["requests"] == 8
    for run in [report["replay"], *report["sweep"].values()]:
        assert run["requests"] == 8 and run["failed"] == 0
        assert run["ttft_ms"]["p50"] > 0 and run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
        assert 0 <= run["goodput_req_per_s"] <= run["req_per_s"]
        # each request's client figures against the server's pipeline_timings for it: HTTP adds >= 0 to TTFT
        assert 0 < run["pipeline_ttft_ms"]["p50"] <= run["ttft_ms"]["p50"]
        assert run["http_added_ttft_ms"]["p50"] >= 0 and run["http_added_tpot_ms"]["p50"] is not None
    assert "HTTP added (each request's figure minus the server's pipeline_timings, p50): TTFT +" in cli.stdout
    assert report["knee"] in (1, 4) and png.stat().st_size > 1000 and "knee:" in cli.stdout
    bad = subprocess.run([sys.executable, "-m", "flexpipe_dag.cli", "loadtest", "--url", "http://127.0.0.1:9/v1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot reach" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


#: A server whose one stage raises after 40 steps (the runtime's fault hook), on the port the kernel picks.
FAULTY_SERVER = """
import sys
from flexpipe_dag.core.gear_builders import even_gear
from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
from flexpipe_dag.serving.frontdoor.server import FrontDoorServer, ServerSettings
from tests.test_runtime_helpers import checkpoint
ckpt = checkpoint()
gear = even_gear(ckpt.num_layers, 1, ckpt.name, 8, None, 4096)
runtime = PipelineRuntime(gear, ckpt, RuntimeOptions(stream_tokens=True, step_timeout_s=30.0,
                                                     fault={"stage": 0, "raise_after_steps": 40}))
server = FrontDoorServer(runtime, ckpt.tokenizer(), ckpt.eos_token_ids(), 8192,
                         ServerSettings(port=0, model_name=ckpt.name))
sys.exit(server.run())
"""


def test_a_failed_pipeline_ends_open_requests_with_503_and_stops_the_server(tmp_path):
    srv = Server(env={"FLEXPIPE_HOME": str(tmp_path)}, command=[sys.executable, "-c", FAULTY_SERVER])
    client = openai.OpenAI(base_url=srv.wait_bound() + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.APIError) as err:  # 40 steps in: the stage raises under this request
        list(client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=200, temperature=0,
                                       stream=True))
    assert "the pipeline failed" in str(err.value.body or err.value.message)
    assert srv.proc.wait(timeout=120) == 1  # for its supervisor to start a fresh one
    srv.stop()
    log = "\n".join(srv.lines)
    assert "pipeline failed:" in log and "1 open request(s) ended with 503" in log, log[-3000:]
