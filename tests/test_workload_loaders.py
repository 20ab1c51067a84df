"""Workload loaders on the real bundled traces and on bad inputs."""

from __future__ import annotations

import csv
import json
from decimal import Decimal
from pathlib import Path

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.workload import (
    Request,
    UnsortedTraceWarning,
    Workload,
    bundled_path,
    load_azure_trace,
    load_length_file,
    load_request_file,
    load_trace,
    mix,
    speedup,
    time_window,
    to_plain_dicts,
    write_requests_jsonl,
)


def _csv_rows(name: str) -> list[dict[str, str]]:
    """The bundled trace's rows as plain text, read with the csv module (not the loader under test)."""
    with open(bundled_path(name), newline="") as f:
        return list(csv.DictReader(f))


def _clock_s(stamp: str) -> Decimal:
    """``"2023-11-16 18:15:46.6805900"`` -> seconds since midnight, every fractional digit kept."""
    h, m, s = stamp.split(" ")[1].split(":")
    return int(h) * 3600 + int(m) * 60 + Decimal(s)


def test_azure_conv_real_trace():
    w = load_trace("azure-conv")
    rows = _csv_rows("azure-conv")
    assert len(w) == len(rows) and len(rows) > 19_000  # README: 19,366 requests over ~58 min
    assert w.requests[0].arrival_s == 0.0
    # e.g. 18:15:50.9951690 - 18:15:46.6805900: the 7th fractional digit is kept
    gap = _clock_s(rows[1]["TIMESTAMP"]) - _clock_s(rows[0]["TIMESTAMP"])
    assert w.requests[1].arrival_s == pytest.approx(float(gap), abs=1e-9)
    assert (w.requests[0].input_tokens, w.requests[0].output_tokens) == (int(rows[0]["ContextTokens"]),
                                                                         int(rows[0]["GeneratedTokens"]))
    assert 3400 < w.duration_s < 3600
    assert all(r.klass == "online" for r in w.requests[:50])
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w.requests, w.requests[1:]))


def test_azure_code_and_arxiv_backlog():
    code = load_trace("azure-code")
    assert len(code) == len(_csv_rows("azure-code"))
    arxiv = load_trace("arxiv-summarization")
    first = _csv_rows("arxiv-summarization")
    assert len(arxiv) == len(first) == 2000  # the bundled slice: the first 2,000 rows (data/README.md)
    assert (arxiv.requests[0].input_tokens, arxiv.requests[0].output_tokens) == (int(first[0]["num_prefill_tokens"]),
                                                                                 int(first[0]["num_decode_tokens"]))
    assert {r.klass for r in arxiv} == {"offline"} and {r.arrival_s for r in arxiv} == {0.0}
    lim = load_length_file(bundled_path("arxiv-summarization"), limit=10, arrival_s=5.0)
    assert len(lim) == 10 and lim.requests[0].arrival_s == 5.0


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_bad_timestamp_names_row_and_field(tmp_path):
    p = _write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,3,4\nnot-a-time,3,4\n")
    with pytest.raises(InputError) as e:
        load_azure_trace(p)
    assert e.value.source == str(p) and e.value.field == "row 2.TIMESTAMP" and "expected a timestamp" in e.value.problem


def test_negative_tokens_rejected(tmp_path):
    p = _write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,3,-4\n")
    with pytest.raises(InputError) as e:
        load_azure_trace(p)
    assert e.value.field == "row 1.GeneratedTokens" and ">= 1" in e.value.problem


@pytest.mark.parametrize("text", ["", "arrival_s,input_tokens,output_tokens\n"])
def test_empty_file_and_header_only(tmp_path, text):
    p = _write(tmp_path, "e.csv", text)
    with pytest.raises(InputError) as e:
        load_request_file(p)
    assert e.value.source == str(p)


def test_missing_column(tmp_path):
    p = _write(tmp_path, "m.csv", "arrival_s,input_tokens\n0,3\n")
    with pytest.raises(InputError) as e:
        load_request_file(p)
    assert e.value.field == "output_tokens"


def test_unsorted_is_sorted_with_warning(tmp_path):
    p = _write(tmp_path, "u.csv", "request_id,arrival_s,input_tokens,output_tokens\na,2.0,5,5\nb,1.0,6,6\nc,3.0,7,7\n")
    with pytest.warns(UnsortedTraceWarning, match="1 row arrives before"):
        w = load_request_file(p)
    assert [r.request_id for r in w] == ["b", "a", "c"]


@pytest.mark.parametrize("name, text", [("e.csv", "request_id,arrival_s,input_tokens,output_tokens\n,0,5,5\nb,1,5,5\n"),
                                        ("n.jsonl", '{"request_id": null, "arrival_s": 0, "input_tokens": 5, "output_tokens": 5}\n'),
                                        ("s.jsonl", '{"request_id": "  ", "arrival_s": 0, "input_tokens": 5, "output_tokens": 5}\n')])
def test_empty_request_id_is_refused_by_row(tmp_path, name, text):
    """An empty id cell (or JSON null) is named by row, not a TypeError out of pandas."""
    with pytest.raises(InputError, match="empty; expected an id") as e:
        load_request_file(_write(tmp_path, name, text))
    assert e.value.field == "row 1.request_id"


@pytest.mark.parametrize("text, field", [
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5}\n{"arrival_s": 1, "input_tokens": true, "output_tokens": 5}\n',
     "row 2.input_tokens"),
    ('{"arrival_s": true, "input_tokens": 5, "output_tokens": 5}\n', "row 1.arrival_s"),
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5, "priority": false}\n', "row 1.priority")])
def test_booleans_are_not_numbers(tmp_path, text, field):
    """JSON true / false where a number belongs is refused, not read as 1 / 0."""
    with pytest.raises(InputError, match="got True|got False") as e:
        load_request_file(_write(tmp_path, "b.jsonl", text))
    assert e.value.field == field
    csv_bools = _write(tmp_path, "b.csv", "arrival_s,input_tokens,output_tokens\n0,True,5\n1,False,5\n")
    with pytest.raises(InputError, match="row 1.input_tokens"):
        load_request_file(csv_bools)


@pytest.mark.parametrize("text, field", [
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5}\n{"arrival_s": 1, "input_tokens": "10", "output_tokens": 5}\n',
     "row 2.input_tokens"),
    ('{"arrival_s": "0.5", "input_tokens": 5, "output_tokens": 5}\n', "row 1.arrival_s"),
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 5, "priority": "1"}\n', "row 1.priority")])
def test_quoted_numbers_in_a_jsonl_trace_are_refused(tmp_path, text, field):
    """JSON has numbers: a string of one is refused as the cluster and gear files refuse it (CSV is text: parsed)."""
    with pytest.raises(InputError, match="got the string .*; expected a JSON number") as e:
        load_request_file(_write(tmp_path, "q.jsonl", text))
    assert e.value.field == field
    csv = _write(tmp_path, "q.csv", "arrival_s,input_tokens,output_tokens,priority\n0.5,10,5,1\n")
    assert load_request_file(csv).requests[0].input_tokens == 10


def test_generic_class_priority_and_bad_class(tmp_path):
    p = _write(tmp_path, "g.csv", "arrival_s,input_tokens,output_tokens,class,priority\n0,5,5,offline,3\n1,5,5,online,0\n")
    w = load_request_file(p)
    assert (w.requests[0].klass, w.requests[0].priority) == ("offline", 3)
    bad = _write(tmp_path, "b.csv", "arrival_s,input_tokens,output_tokens,class\n0,5,5,batch\n")
    with pytest.raises(InputError) as e:
        load_request_file(bad)
    assert e.value.field == "row 1.class"
    neg = _write(tmp_path, "n.csv", "arrival_s,input_tokens,output_tokens\n-1,5,5\n")
    with pytest.raises(InputError, match="row 1.arrival_s"):
        load_request_file(neg)


def test_jsonl_round_trip_is_the_fidelity_hook(tmp_path):
    w = time_window(load_trace("azure-conv"), 0, 60)
    path = write_requests_jsonl(w, tmp_path / "w.jsonl")
    back = load_request_file(path)
    assert back.requests == w.requests
    dicts = to_plain_dicts(w)
    assert dicts[0] == json.loads(path.read_text().splitlines()[0])
    assert set(dicts[0]) == {"request_id", "arrival_s", "input_tokens", "output_tokens", "class", "priority"}


def test_speedup_and_mix():
    w = time_window(load_trace("azure-conv"), 0, 120)
    fast = speedup(w, 4.0)
    assert fast.duration_s == pytest.approx(w.duration_s / 4)
    with pytest.raises(InputError):
        speedup(w, 0)
    backlog = load_length_file(bundled_path("arxiv-summarization"), limit=20)
    both = mix(w, backlog)
    assert both.count_by_class() == {"online": len(w), "offline": 20}
    with pytest.raises(InputError, match="more than one workload"):
        mix(w, w)


def test_unknown_bundled_name():
    with pytest.raises(InputError, match="azure-conv"):
        load_trace("no-such-trace")


def test_tide_as_a_request_trace_says_what_to_give_not_a_python_function():
    # `capacity --trace servegen-tide` said "load it with load_tide_trace", and the list of traces offered
    # for a missing file named the tide among them
    with pytest.raises(InputError) as exc:
        load_trace("servegen-tide")
    assert "rate series (tide), not requests; expected a request trace" in exc.value.problem
    assert "load_tide_trace" not in exc.value.problem and "servegen-tide" not in exc.value.problem
    with pytest.raises(InputError) as exc:
        load_trace("no-such-trace")
    assert "azure-conv" in exc.value.problem and "servegen-tide" not in exc.value.problem


def test_workload_from_requests_sorts():
    w = Workload.from_requests([Request("b", 2.0, 1, 1), Request("a", 1.0, 1, 1)], name="x")
    assert [r.request_id for r in w] == ["a", "b"]


def test_zone_offsets_and_far_years_are_read_not_tracebacks(tmp_path):
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    zoned = _write(tmp_path, "z.csv", header + "2023-11-16 18:15:46+05:00,10,5\n2023-11-16 14:15:47.25+01:00,10,5\n")
    assert [r.arrival_s for r in load_azure_trace(zoned).requests] == [0.0, 1.25]  # zones agree once in UTC
    far = _write(tmp_path, "f.csv", header + "2262-04-12 00:00:00,10,5\n2262-04-12 00:00:01.5,10,5\n")
    assert [r.arrival_s for r in load_azure_trace(far).requests] == [0.0, 1.5]  # past pandas' nanosecond range
    apart = _write(tmp_path, "a.csv", header + "1677-09-21 00:12:43,10,5\n2023-11-16 18:15:46,10,5\n")
    with pytest.raises(InputError) as e:
        load_azure_trace(apart)
    assert e.value.field == "row 2.TIMESTAMP" and "31 days" in e.value.problem


@pytest.mark.parametrize("line, problem", [
    ("[1, 2]", "got a JSON list; expected one object per line"),
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 3, "input_tokens": 6}', "duplicate key 'input_tokens'"),
    ('{"arrival_s": NaN, "input_tokens": 5, "output_tokens": 3}', "NaN is not a number JSON allows"),
    ('{"arrival_s": 0, "input_tokens": 5', "not valid JSON"),
])
def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path, line, problem):
    p = _write(tmp_path, "t.jsonl", '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 3}\n\n' + line + "\n")
    with pytest.raises(InputError) as e:
        load_trace(p)
    assert e.value.source == str(p) and e.value.field == "line 3" and problem in e.value.problem, str(e.value)
