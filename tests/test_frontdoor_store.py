"""The front door in the store, without a model: its endpoint registered with the heartbeat and found by
`flexpipe servers` and `flexpipe loadtest`, stored gears named by kind or id for `flexpipe serve --gear`,
the day's shifts read back from the store, and the Batch API input the day submits."""

from __future__ import annotations

import datetime as dt
import json
from types import SimpleNamespace

import pytest
from sqlalchemy import update

from flexpipe_dag.cli import main
from flexpipe_dag.cli.serve import stored_gears
from flexpipe_dag.cli.servers import live_endpoint
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear_builders import even_gear
from flexpipe_dag.serving.frontdoor.batches import parse_batch_input
from flexpipe_dag.serving.frontdoor.day import batch_input, decisions_from_events
from flexpipe_dag.serving.loadtest import LoadRequest
from flexpipe_dag.sql import models as m


def test_a_front_door_registers_its_endpoint_and_drops_out_when_it_ends_or_goes_silent(store):
    store.heartbeat_pipeline_run("fd-a", "serve", "g1")  # first heartbeat: port not bound yet
    store.heartbeat_pipeline_run("fd-a", "serve", "g1", endpoint="http://127.0.0.1:8123/v1")
    store.heartbeat_pipeline_run("fd-b", "serve", "g2", inline_control=True)  # a serve_trace run: no API
    store.heartbeat_pipeline_run("job-c", "batch", "g1")
    runs = {r.run_key: r for r in store.live_serving_runs()}
    assert set(runs) == {"fd-a", "fd-b"}  # batch jobs are not servers
    assert runs["fd-a"].endpoint == "http://127.0.0.1:8123/v1" and runs["fd-a"].gear_key == "g1"
    assert runs["fd-b"].endpoint is None and runs["fd-b"].inline_control
    store.heartbeat_pipeline_run("fd-a", "serve", "g3")  # a later heartbeat without it keeps the endpoint
    assert live_endpoint(store) == "http://127.0.0.1:8123/v1"
    with store.session() as s:  # fd-a goes silent: a server killed without ending its run
        s.execute(update(m.PipelineRun).where(m.PipelineRun.run_key == "fd-a")
                  .values(heartbeat_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=120)))
    assert [r.run_key for r in store.live_serving_runs(30.0)] == ["fd-b"]
    assert {r.run_key for r in store.live_serving_runs(600.0)} == {"fd-a", "fd-b"}
    store.end_pipeline_run("fd-b")
    assert [r.run_key for r in store.live_serving_runs(600.0)] == ["fd-a"]
    with pytest.raises(InputError, match="no live front door in the store"):
        live_endpoint(store, 30.0)
    with pytest.raises(InputError, match="endpoint"):
        store.heartbeat_pipeline_run("fd-d", "serve", endpoint="x" * 301)


def test_servers_lists_the_live_front_door_and_loadtest_finds_it(tmp_path, monkeypatch, capsys):
    from flexpipe_dag.sql.store import Store

    monkeypatch.setenv("FLEXPIPE_HOME", str(tmp_path))
    monkeypatch.delenv("FLEXPIPE_DATABASE_URL", raising=False)
    assert main(["servers"]) == 0 and "no live serving run" in capsys.readouterr().out
    Store.from_url().heartbeat_pipeline_run("fd-x", "serve", "latency-1", endpoint="http://127.0.0.1:9/v1")
    assert main(["servers", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run_key"], r["endpoint"], r["gear"]) for r in rows] == [("fd-x", "http://127.0.0.1:9/v1", "latency-1")]
    assert main(["servers"]) == 0 and "http://127.0.0.1:9/v1" in capsys.readouterr().out
    # no --url: the store's live front door is the one tried (nothing listens on port 9)
    assert main(["loadtest", "--requests", "1", "--concurrency", ""]) == 2
    err = capsys.readouterr().err
    assert "the live front door in the store: http://127.0.0.1:9/v1" in err and "cannot reach http://127.0.0.1:9" in err


def test_serve_gear_names_a_stored_gear_by_kind_or_id(store, lab_profile):
    info = store.save_profile(lab_profile)
    base = even_gear(30, 2, "SmolLM2-135M", 4, None, 4096)
    gears = [base.model_copy(update={"gear_id": f"{kind}-x", "kind": kind}) for kind in ("latency", "throughput")]
    with pytest.raises(InputError, match="holds no planned gears"):
        stored_gears(store, "latency")
    store.save_gears(gears, info.id, store.save_model("SmolLM2-135M", "fp32", 30, {"layers": 30}))
    first, all_gears = stored_gears(store, "throughput")
    assert first.gear_id == "throughput-x" and [g.gear_id for g in all_gears] == ["latency-x", "throughput-x"]
    assert stored_gears(store, "latency-x")[0].kind == "latency"
    with pytest.raises(InputError, match=r"'fast' is none of those \(stored: latency-x \(latency\), throughput-x"):
        stored_gears(store, "fast")


def test_the_days_shifts_and_declines_are_read_back_from_the_stored_events():
    events = [SimpleNamespace(action="hold", status="declined", from_gear_key="a", to_gear_key="b", trigger="load_high",
                              reason="dwell: 12 s of 30 s", details={"t_s": 20.5, "reason_kind": "dwell"}),
              SimpleNamespace(action="shift", status="done", from_gear_key="a", to_gear_key="b", trigger="load_high",
                              reason="load above the envelope", details={"t_s": 41.0, "timings_s": {"total": 9.5},
                                                                         "outcome": "switched"})]
    shifts, declines = decisions_from_events(events)
    assert shifts == [{"t_s": 41.0, "from_gear": "a", "to_gear": "b", "trigger": "load_high",
                       "reason": "load above the envelope", "status": "done", "outcome": "switched",
                       "timings_s": {"total": 9.5}}]
    assert declines == [{"t_s": 20.5, "from_gear": "a", "to_gear": "b", "trigger": "load_high",
                         "reason": "dwell: 12 s of 30 s", "kind": "dwell"}]


def test_the_days_batch_input_is_a_batch_file_the_server_accepts():
    reqs = [LoadRequest([1, 2, 3], 12), LoadRequest([7] * 40, 5, arrival_s=3.0)]
    lines = parse_batch_input(batch_input(reqs, "m"), "/v1/completions", "file-1")
    assert [(ln.custom_id, ln.index) for ln in lines] == [("offline-0", 0), ("offline-1", 1)]
    assert [(ln.body["prompt"], ln.body["max_tokens"], ln.body["temperature"]) for ln in lines] == [([1, 2, 3], 12, 0), ([7] * 40, 5, 0)]


def test_serve_plan_starts_on_the_gear_the_plan_recommends_for_the_load(store, lab_profile, capsys):
    from flexpipe_dag.cli.serve import planned_gear

    info = store.save_profile(lab_profile)
    with pytest.raises(InputError, match="--plan.*holds no planned gears"):
        planned_gear(store, None)
    small = even_gear(30, 1, "SmolLM2-135M", 4, None, 4096).model_copy(
        update={"gear_id": "latency-1s", "kind": "latency", "rps_max": 2.0})
    big = even_gear(30, 2, "SmolLM2-135M", 8, None, 4096).model_copy(
        update={"gear_id": "throughput-2s", "kind": "throughput", "rps_max": 6.0})
    store.save_gears([big, small], info.id, store.save_model("SmolLM2-135M", "fp32", 30, {"layers": 30}))
    gear, gears, why = planned_gear(store, None)  # no load: the latency gear, the others are shift targets
    assert gear.gear_id == "latency-1s" and {g.gear_id for g in gears} == {"latency-1s", "throughput-2s"}
    assert "latency gear" in why
    assert planned_gear(store, 1.5)[0].gear_id == "latency-1s"  # fewest devices holding 1.5 req/s, 25 % headroom
    assert planned_gear(store, 1.9)[0].gear_id == "throughput-2s"  # the small one would keep only 5 % headroom
    gear, _, why = planned_gear(store, 9.0)
    assert gear.gear_id == "throughput-2s" and "no gear holds 9 req/s" in why
    with pytest.raises(InputError, match="load_rps"):
        planned_gear(store, -1.0)
    capsys.readouterr()
    assert main(["serve", "--stages", "1", "--load-rps", "2", "--no-store"]) == 2  # refused before a model loads
    assert "--load-rps: only means something with --plan" in capsys.readouterr().err
    assert main(["serve", "--plan", "--no-store"]) == 2
    assert "--plan: the plan is read from the store: drop --no-store" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--concurrency", ","], "--concurrency: expected comma-separated integers"),
    (["--concurrency", "1,,2"], "--concurrency: expected comma-separated integers"),
    (["--concurrency", "0,2"], "--concurrency: expected levels 1..10000"),
    (["--slo-ttft-ms", "-1"], "--slo-ttft-ms: expected a finite number > 0"),
    (["--slo-tpot-ms", "nan"], "--slo-tpot-ms: expected a finite number > 0"),
    (["--speedup", "0"], "--speedup: expected a finite number >= 0.001 and <= 1e+06 (factor), got 0.0"),
    (["--speedup", "1e9"], "--speedup: expected a finite number >= 0.001 and <= 1e+06 (factor), got 1000000000.0"),
])
def test_loadtest_refuses_bad_flags_in_one_line_before_sending_anything(flags, message, capsys):
    assert main(["loadtest", "--url", "http://127.0.0.1:9/v1", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot reach" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("url", "trace", "message"), [
    ("ftp://x", "azure-conv",
     "--url: expected an http(s) URL such as http://127.0.0.1:8000/v1 (no query or fragment), got 'ftp://x'"),
    ("127.0.0.1:8000", "azure-conv", "--url: expected an http(s) URL"),
    ("http://127.0.0.1:9/v1?x=1", "azure-conv", "--url: expected an http(s) URL such as http://127.0.0.1:8000/v1 (no "
                                                "query or fragment)"),
    ("http://me:secret@127.0.0.1:9/v1", "azure-conv", "--url: expected no user or password in the URL"),
    # the trace is checked before the network: its error, not a refused connection, is what the user sees
    ("http://127.0.0.1:9/v1", "/no/such/trace.csv", "/no/such/trace.csv: file not found"),
])
def test_loadtest_checks_the_url_and_the_trace_before_connecting(url, trace, message, capsys):
    assert main(["loadtest", "--url", url, "--trace", trace]) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot reach" not in err and len(err.strip().splitlines()) == 1


def test_loadtest_names_a_server_that_is_not_an_openai_api(capsys):
    """Seen: a base URL without /v1 (a web page at /models) was read as JSON, and a trailing / made //models."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # the stdlib handler's name
            body = b"<html>not here</html>"
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        assert main(["loadtest", "--url", url, "--requests", "2"]) == 2
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert f"{url}models answered 404 without a model list (the base URL of an OpenAI-compatible API usually ends " \
           "in /v1)" in err and "//models" not in err


def test_the_operator_drill_asks_the_live_server_for_one_shift_only_when_none_was_made(store):
    import threading

    from flexpipe_dag.core.status import ShiftEventStatus
    from flexpipe_dag.jobs.serve_frontdoor import operator_drill

    base = even_gear(30, 2, "SmolLM2-135M", 4, None, 4096)
    gears = [base.model_copy(update={"gear_id": gid, "rps_max": r}) for gid, r in (("g-live", 1.0), ("g-big", 2.0),
                                                                                    ("g-mid", 1.5))]
    said: list[str] = []
    store.heartbeat_pipeline_run("fd-1", "serve", "g-live")
    assert operator_drill(store, "fd-1", gears[:1], 0.0, threading.Event(), said.append) is None
    assert "nothing to shift to" in said[-1] and store.shift_events(run_key="fd-1") == []
    stopped = threading.Event()
    stopped.set()  # the day ended before the drill's time
    assert operator_drill(store, "fd-1", gears, 5.0, stopped, said.append) is None
    event_id = operator_drill(store, "fd-1", gears, 0.0, threading.Event(), said.append, started_s=None)
    [ev] = store.pending_shift_requests("fd-1")  # addressed to the live server, to the largest other envelope
    assert ev.id == event_id and (ev.from_gear_key, ev.to_gear_key, ev.trigger) == ("g-live", "g-big", "manual")
    assert ev.status == ShiftEventStatus.REQUESTED.value and "operator drill" in ev.reason
    assert operator_drill(store, "fd-1", gears, 0.0, threading.Event(), said.append) is None  # a shift was made
    assert said[-1] == "operator drill: not needed, the controller has shifted"


def test_the_default_day_starts_above_the_first_gear_and_peaks_within_the_largest_envelope():
    """1.5 x the first gear's envelope, unless the tide's peak would then exceed 80 % of the largest
    envelope (a plan of one gear, or of gears of about one rate): then the day is lowered to fit."""
    from flexpipe_dag.jobs.serve import (
        PEAK_ENVELOPE_SHARE,
        PEAK_WINDOW_S,
        ServeTraceConfig,
        build_workloads,
        day_mean_rps,
    )

    config = ServeTraceConfig()
    small, large = SimpleNamespace(rps_max=0.4), SimpleNamespace(rps_max=1.2)
    assert day_mean_rps(config, [small, large], small) == pytest.approx(0.6)  # its peak fits in 1.2
    mean = day_mean_rps(config, [large], large)  # one gear: 1.8 req/s would overload it all day
    assert mean < 1.5 * large.rps_max
    online, _, _ = build_workloads(config, mean)
    assert online.peak_rate_rps(PEAK_WINDOW_S) <= PEAK_ENVELOPE_SHARE * large.rps_max * 1.03
    assert day_mean_rps(ServeTraceConfig(mean_rps=3.0), [large], large) == 3.0  # asked for: kept


def test_a_failed_day_names_its_commonest_errors_in_one_line():
    from flexpipe_dag.jobs.serve_frontdoor import failure_kinds

    assert failure_kinds([]) == ""
    failed = [{"error": "HTTP 429: queue full"}] * 3 + [{"error": "HTTP 503: draining"}]
    assert failure_kinds(failed) == "; errors: 3 x HTTP 429: queue full; 1 x HTTP 503: draining"
