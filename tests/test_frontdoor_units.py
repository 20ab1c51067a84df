"""The front door's pieces without a server: incremental detokenisation, request checks, batch files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flexpipe_dag.serving.frontdoor.batches import parse_batch_input
from flexpipe_dag.serving.frontdoor.engine import IncrementalDetokenizer, _first_stop
from flexpipe_dag.serving.frontdoor.protocol import APIError, ChatCompletionRequest, CompletionRequest
from tests.test_runtime_helpers import checkpoint

CORPUS = Path(__file__).resolve().parents[1] / "flexpipe_dag" / "data" / "corpus"
TEXTS = ["The capital of France is Paris. Émile a dit : « bonjour » — 你好，世界! 🚀🚀 done",
         "  leading spaces\n\n\tand tabs", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"]


@pytest.mark.parametrize("text", TEXTS + [next(CORPUS.glob("*.txt")).read_text(encoding="utf-8")[:2000]])
def test_incremental_text_equals_a_full_decode_token_by_token(text):
    tok = checkpoint().tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"] + list(checkpoint().eos_token_ids()[:1])
    detok = IncrementalDetokenizer(tok)
    seen = []
    for n in range(1, len(ids) + 1):
        seen.append(detok.text_of(ids[:n], final=n == len(ids)))
    assert seen[-1] == tok.decode(ids, skip_special_tokens=True)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # text only grows: a stream never takes back
    assert not any(s.endswith("\ufffd") for s in seen[:-1])  # half a character is never sent


def test_request_checks_name_the_field():
    with pytest.raises(ValueError, match="at most 4 stop sequences"):
        CompletionRequest(model="m", prompt="p", stop=["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match="may not be empty"):
        CompletionRequest(model="m", prompt="p", stop=[""])
    assert CompletionRequest(model="m", prompt="p", stop="x").stop_sequences == ["x"]
    assert CompletionRequest(model="m", prompt="p", n=2).unsupported()[0] == "n"
    assert CompletionRequest(model="m", prompt="p", echo=True).unsupported()[0] == "echo"
    with pytest.raises(APIError, match="one prompt per request, got a list of 2"):
        CompletionRequest(model="m", prompt=["a", "b"]).single_prompt()
    assert CompletionRequest(model="m", prompt=[[1, 2]]).single_prompt() == [1, 2]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                   {"type": "text", "text": "b"}]}])
    assert chat.messages[0].text() == "ab"
    with pytest.raises(APIError, match="only text content parts"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}]
                              ).messages[0].text()
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "a"}], max_tokens=5,
                                 max_completion_tokens=7).requested_max_tokens == 7
    for tools in ([], [{"type": "function", "function": {"name": "f"}}]):  # OpenAI refuses an empty list too
        assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "a"}],
                                     tools=tools).unsupported()[0] == "tools"
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "a"}], tools=None).unsupported() is None
    assert _first_stop("abc STOP def END", ("END", "STOP"), 0) == 4 and _first_stop("abc", ("x",), 0) is None
    for role in ("user", "system", "developer"):  # was served as empty text
        for message in ({"role": role, "content": None}, {"role": role}):
            with pytest.raises(ValueError, match=f"a {role} message needs its content"):
                ChatCompletionRequest(model="m", messages=[message])
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}, {"role": "user", "content": "b"}]
    assert [m.text() for m in ChatCompletionRequest(model="m", messages=history).messages] == ["a", "", "b"]


def test_a_batch_file_is_checked_whole_naming_the_line():
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "p"}}
    ok = (json.dumps(line) + "\n\n" + json.dumps({**line, "custom_id": "b"}) + "\n").encode()
    assert [(x.index, x.custom_id) for x in parse_batch_input(ok, "/v1/completions", "f")] == [(0, "a"), (1, "b")]
    # JSON lines split at "\n" only: U+2028 / U+2029 / U+0085 are text inside a string (written raw by
    # json.dumps(ensure_ascii=False)); a CRLF ending and a leading byte-order mark are not a line's
    raw = [json.dumps({**line, "custom_id": c, "body": {"model": "m", "prompt": f"x{ch}y"}}, ensure_ascii=False)
           for c, ch in (("u2028", "\u2028"), ("u2029", "\u2029"), ("nel", "\x85"))]
    odd = ("\ufeff" + "\r\n".join(raw) + "\r\n").encode()
    got = parse_batch_input(odd, "/v1/completions", "f")
    assert [(x.index, x.custom_id, x.body["prompt"]) for x in got] == [
        (0, "u2028", "x\u2028y"), (1, "u2029", "x\u2029y"), (2, "nel", "x\x85y")]
    for content, needle in ((b"\xff\xfe", "line 1: not UTF-8 text (byte 0 of the file)"), (b"", "no request lines"),
                            (ok + b"\xff", "line 4: not UTF-8 text"),
                            (b"{bad", "line 1: not valid JSON"), (b"[1]", "line 1: expected a JSON object"),
                            (json.dumps({**line, "custom_id": ""}).encode(), "line 1: custom_id"),
                            (json.dumps({**line, "method": "GET"}).encode(), "line 1: method: expected POST"),
                            # JSON's escapes allow a lone surrogate, UTF-8 does not (it once stalled the runner)
                            (b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", "body": {}}',
                             "line 1: custom_id: holds a lone UTF-16 surrogate"),
                            # which of a repeated key's values was meant is not known
                            (b'{"custom_id": "a", "custom_id": "b", "method": "POST", "url": "/v1/completions", '
                             b'"body": {}}', "line 1: not valid JSON: duplicate key 'custom_id'"),
                            (json.dumps({**line, "body": {"prompt": "p", "temperature": float("nan")}}).encode(),
                             "line 1: not valid JSON: NaN is not a number JSON allows"),
                            (json.dumps({**line, "custom_id": "a b\u202e"}).encode(),
                             "line 1: custom_id: 'a b\\u202e' holds '\\u202e' at character 4")):
        with pytest.raises(APIError, match=re.escape(needle)) as err:
            parse_batch_input(content, "/v1/completions", "f")
        assert err.value.status == 400 and err.value.param == "input_file_id"


def test_lone_surrogates_are_refused_naming_the_field_and_strict_fields_are_not_coerced():
    from pydantic import ValidationError

    from flexpipe_dag.serving.frontdoor.protocol import CompletionRequest, lone_surrogate_path

    assert lone_surrogate_path({"messages": [{"role": "user", "content": "ok \udc00"}]}) == "messages.0.content"
    assert lone_surrogate_path({"stop": ["a", "\ud800"]}) == "stop.1" and lone_surrogate_path({"a": ["ok", 1]}) is None
    with pytest.raises(APIError, match=r"^prompt: holds a lone UTF-16 surrogate") as err:
        CompletionRequest.model_validate({"model": "m", "prompt": "\ud800 x"})
    assert err.value.status == 400 and err.value.param == "prompt"
    with pytest.raises(APIError, match=r"^model: holds"):
        ChatCompletionRequest.model_validate({"model": "\ud800", "messages": [{"role": "user", "content": "a"}]})
    for field, value in (("max_tokens", "2"), ("max_tokens", True), ("stream", "yes"), ("temperature", "0.5"),
                         ("temperature", float("nan")), ("stream_options", {"include_usage": "x"})):
        with pytest.raises(ValidationError) as verr:
            CompletionRequest.model_validate({"model": "m", "prompt": "p", field: value})
        assert verr.value.errors()[0]["loc"][0] == field
    assert CompletionRequest.model_validate({"model": "m", "prompt": "p", "temperature": 0}).temperature == 0.0


def test_pipeline_timings_count_each_token_once_and_end_a_cut_at_the_stop_token():
    from flexpipe_dag.runtime.scheduler import RequestOutput
    from flexpipe_dag.serving.frontdoor.engine import Generation, _Stream, pipeline_timings

    stream = _Stream(Generation([1, 2, 3], 8), accepted_s=0.0)
    stream.submitted_s = 1.0
    for index, token, at_s in [(0, 10, 1.5), (1, 11, 1.6), (1, 11, 1.9), (2, 12, 1.7)]:  # index 1 re-sent late
        stream.on_token(index, token)
        stream.arrived("on_token", at_s)
    assert stream.token_arrival_s == [1.5, 1.6, 1.7]  # the re-sent index adds no arrival
    cut = pipeline_timings(stream, completion_tokens=2, cut=True)  # the stop completed at the 2nd token
    assert cut == {"ttft_ms": 500.0, "e2e_ms": 600.0, "tpot_ms": 100.0}
    out = RequestOutput("r", [1, 2, 3], [10, 11, 12, 13], "length", 0.0, 0.1, 0.2)  # one token not streamed
    stream.on_output(out)
    stream.arrived("on_output", 2.0)
    assert stream.token_arrival_s == [1.5, 1.6, 1.7, 2.0]
    assert pipeline_timings(stream, completion_tokens=4) == {"ttft_ms": 500.0, "e2e_ms": 1000.0, "tpot_ms": 166.667}
    only = _Stream(Generation([1], 1), accepted_s=0.0)
    only.submitted_s = 0.0
    only.on_output(out)
    only.arrived("on_output", 0.25)  # no token streamed first: the result brings them all
    assert pipeline_timings(only, completion_tokens=1)["tpot_ms"] is None


def test_an_uploaded_files_name_is_listed_without_directories_or_unprintable_characters():
    from flexpipe_dag.serving.frontdoor.app import upload_filename

    assert upload_filename("../../etc/passwd\x01") == "passwd"
    assert upload_filename("C:\\batches\\day 1.jsonl") == "day 1.jsonl"
    assert upload_filename("a\u202eb.jsonl") == "ab.jsonl"
    assert [upload_filename(n) for n in (None, "", "..", " \x00 ")] == ["upload.jsonl"] * 4
    assert len(upload_filename("x" * 1000)) == 255


def test_batch_metadata_has_openais_limits():
    from pydantic import ValidationError

    from flexpipe_dag.serving.frontdoor.protocol import BatchCreateRequest

    ok = {"input_file_id": "file-1", "endpoint": "/v1/completions"}
    assert BatchCreateRequest(**ok, metadata={f"k{i}": "v" * 512 for i in range(16)}).metadata["k15"] == "v" * 512
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(ValidationError, match="metadata"):
            BatchCreateRequest(**ok, metadata=metadata)


def test_max_tokens_is_checked_against_the_served_length_and_its_default_is_a_fair_share_of_a_kv_lane():
    from types import SimpleNamespace

    from flexpipe_dag.serving.frontdoor.engine import FrontDoorEngine
    from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics

    engine = FrontDoorEngine(None, (0,), 8192, FrontDoorMetrics())
    assert engine.check_context(100, None, "messages") == 8092  # no pipeline yet: the context's rest
    # a pipeline whose KV lane holds less than the context: /v1/models says max_model_len 1025
    lane = SimpleNamespace(gear=SimpleNamespace(micro_batch_size=8), refusal_policy="final",
                           runtime=SimpleNamespace(longest_request_tokens=1025))
    engine.router = SimpleNamespace(active=lane, instances=[lane])
    assert engine.max_model_len == 1025 and engine.fair_share_tokens == 128
    assert engine.check_context(39, None, "messages") == 128  # not 8153: the context would never fit the lane
    assert engine.check_context(950, None, "messages") == 75  # what the served length leaves
    assert engine.check_context(39, 986, "messages") == 986
    for prompt, max_tokens in ((39, 987), (1025, None)):
        with pytest.raises(APIError, match="maximum context length is 1025 tokens") as err:
            engine.check_context(prompt, max_tokens, "messages")
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    # a degraded shift: the warming gear's pool is small until it grows; requests it cannot hold yet are parked
    # there, not refused at the door, and the default stays the steady state's
    lane.refusal_policy, lane.runtime.longest_request_tokens = "park", 257
    assert engine.fair_share_tokens == 128 and engine.check_context(39, 2000, "messages") == 2000
    assert engine.check_context(39, None, "messages") == 128
    lane.refusal_policy = "final"
    other = SimpleNamespace(gear=SimpleNamespace(micro_batch_size=4), refusal_policy="final",
                            runtime=SimpleNamespace(longest_request_tokens=4097))
    engine.router.instances = [lane, other]  # several instances: the router places each on one that holds it
    assert engine.fair_share_tokens == 32 and engine.check_context(39, 4000, "messages") == 4000  # 257 // 8
    assert engine.max_model_len == 4097  # the most one instance holds
    engine.default_max_tokens = 500  # flexpipe serve --default-max-tokens 500
    assert engine.check_context(39, None, "messages") == 500 and engine.check_context(3900, None, "messages") == 197
    with pytest.raises(APIError, match="maximum context length is 4097 tokens") as err:
        engine.check_context(7900, None, "messages")  # no instance holds it: refused at the door, with the code
    assert err.value.code == "context_length_exceeded"


def test_each_pipeline_has_its_own_gauges_and_a_gone_ones_series_are_dropped():
    from prometheus_client.parser import text_string_to_metric_families

    from flexpipe_dag.core.metrics import MetricSample, StageSample
    from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics

    def sample(queue_length: int, *kv_used: int) -> MetricSample:
        stages = tuple(StageSample(stage_index=i, busy_fraction=0.5, queue_length=0, kv_blocks_used=used,
                                   kv_blocks_total=100) for i, used in enumerate(kv_used))
        return MetricSample(t_s=2.0, gear_id="g", source="live", rps=1.0, completed=1, tokens_per_s=9.0,
                            queue_length=queue_length, running=2, kv_used_fraction=0.1, stages=stages)

    def series(metrics: FrontDoorMetrics, live=None) -> dict:
        text = metrics.exposition(live).decode()
        return {(f.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if f.name in ("flexpipe_kv_blocks_used", "flexpipe_requests_waiting")}

    m = FrontDoorMetrics()
    m.observe_pipeline_sample("g#1", sample(3, 10, 20))
    m.observe_pipeline_sample("g#2", sample(4, 30, 40))
    m.observe_pipeline_sample("g#1", sample(1, 11, 21))  # the newest sample of a pipeline is its figure
    got = series(m)
    used = {labels: v for (name, labels), v in got.items() if name == "flexpipe_kv_blocks_used"}
    assert used == {(("pipeline", "g#1"), ("stage", "0")): 11, (("pipeline", "g#1"), ("stage", "1")): 21,
                    (("pipeline", "g#2"), ("stage", "0")): 30, (("pipeline", "g#2"), ("stage", "1")): 40}
    assert got[("flexpipe_requests_waiting", ())] == 5  # summed over the pipelines
    got = series(m, live=["g#1"])  # g#2 retired: its series go, and its queue no longer counts
    assert {labels for (name, labels) in got if name == "flexpipe_kv_blocks_used"} == {
        (("pipeline", "g#1"), ("stage", "0")), (("pipeline", "g#1"), ("stage", "1"))}
    assert got[("flexpipe_requests_waiting", ())] == 1


def test_a_body_that_is_empty_or_not_json_and_a_text_part_without_text_are_named_plainly():
    """From a hostile-input trial: an empty body said "Field required" with no field, a JSON body sent as
    text/plain said "Input should be a valid dictionary", a text part without its text said "only text
    content parts are served, got type 'text'", and a batch line's bad ``stop`` was named ``stop.str``."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from flexpipe_dag.serving.frontdoor.app import create_app
    from flexpipe_dag.serving.frontdoor.batches import BatchRunner
    from flexpipe_dag.serving.frontdoor.engine import FrontDoorEngine
    from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics

    engine = FrontDoorEngine(None, (), 8192, FrontDoorMetrics())
    http = TestClient(create_app(engine, "m"))
    empty = http.post("/v1/completions", content=b"", headers={"Content-Type": "application/json"})
    assert empty.status_code == 400 and empty.json()["error"]["message"] == \
        "the request body is empty; expected a JSON object"
    plain = http.post("/v1/completions", content=json.dumps({"model": "m", "prompt": "p"}),
                      headers={"Content-Type": "text/plain"})
    assert plain.status_code == 400 and "Content-Type: application/json (got 'text/plain')" in \
        plain.json()["error"]["message"]
    for body, kind in ((b"[1, 2]", "array"), (b'"p"', "string")):  # said "must be ... application/json (got it)"
        other = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert other.status_code == 400 and other.json()["error"]["message"] == \
            f"the request body is a JSON {kind}; expected a JSON object"
    with pytest.raises(APIError, match="a text content part needs its text as a string, got None"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text"}]}]).messages[0].text()
    runner = BatchRunner(None, engine, "m")
    line = SimpleNamespace(body={"model": "m", "prompt": "p", "stop": [3]})
    with pytest.raises(APIError) as err:
        runner._prepare("/v1/completions", line)
    assert err.value.param == "stop" and err.value.message.startswith("stop: ")
