"""Attacks on a run's results file and on its shutdown (issue #15, results files and shutdown).

* a results file whose last line a crash tore (no trailing newline) is repaired at the first append:
  the fragment is truncated away, a note names the file and the bytes, and the request it held runs
  again, so every request ends with exactly one valid line (more cases in test_security_results.py);
* ``kill -TERM`` of a 3-stage local run's head, and a Ctrl-C (SIGINT to the run's whole process
  group, as a terminal sends it), while requests are in flight: every process of the run (the
  forkserver, the resource tracker, the driver, the stage workers) is gone within 10 s, the head
  ends with a one-line reason and exit status 143 / 130, no traceback, what finished is in the
  file, and re-running the same command resumes to exactly one valid line per request.

The signal tests run the real CLI on SmolLM2-135M on CPU in a subprocess started in its own session.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexpipe_dag.runtime.batch import JsonlSink, repair_torn_tail
from tests.support import MODEL_CACHE, REPO
from tests.test_runtime_helpers import checkpoint

psutil = pytest.importorskip("psutil", reason="the signal tests list the run's processes with psutil")

NUM_REQUESTS = 16
#: how long every process of a stopped run may take to be gone (the issue's bar)
GONE_WITHIN_S = 10.0
#: a whole run of the 16 small requests through 3 CPU stages (the first one converts the model)
RUN_TIMEOUT_S = 300.0


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", FLEXPIPE_MODEL_CACHE=MODEL_CACHE, HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO))
    env.pop("FLEXPIPE_FAULT", None)
    return env


def _prompts(path: Path, n: int = NUM_REQUESTS) -> list[str]:
    """``n`` chat-turn prompts (token ids) that make the model write at length: each request runs to
    ``--max-new-tokens``, so a signal after the first result finds the others in flight."""
    tok = checkpoint().tokenizer()
    ids = [f"req-{i:02d}" for i in range(n)]
    rows = []
    for i, rid in enumerate(ids):
        turn = [{"role": "user", "content": f"Write a long story about a lighthouse keeper and the number {i}."}]
        enc = tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=True)
        rows.append(json.dumps({"id": rid, "token_ids": list(enc["input_ids"])}) + "\n")
    path.write_text("".join(rows))
    return ids


def _command(prompts: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "flexpipe_dag.cli", "run", "--stages", "3", "--prompts", str(prompts),
            "--out", str(out), "--micro-batch-size", "1", "--max-new-tokens", "64", "--step-timeout-s", "120"]


def _lines(out: Path) -> list[dict]:
    """Every line of the results file, each of which must be a whole JSON object with a newline."""
    text = out.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), f"torn last line left in {out}: {text[-200:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def _one_line_per_request(out: Path, ids: list[str]) -> None:
    got = [row["id"] for row in _lines(out)]
    assert sorted(got) == sorted(ids), f"expected exactly one line per request, got {sorted(got)}"
    assert all(row["output_tokens"] >= 1 for row in _lines(out))


# -- torn tail --------------------------------------------------------------------------------------
def test_repair_torn_tail_cases(tmp_path):
    path = tmp_path / "r.jsonl"
    assert repair_torn_tail(path) == 0  # missing: nothing to do
    path.write_bytes(b"")
    assert repair_torn_tail(path) == 0
    whole = b'{"id": "a", "gear_id": "g"}\n{"id": "b", "gear_id": "g"}\n'
    path.write_bytes(whole)
    assert repair_torn_tail(path) == 0 and path.read_bytes() == whole
    long_line = json.dumps({"id": "c", "gear_id": "g", "pad": "x" * 200_000}).encode()  # a fragment longer than a read block
    path.write_bytes(whole + long_line[:150_000])
    notes: list[str] = []
    assert repair_torn_tail(path, notes.append) == 150_000
    assert path.read_bytes() == whole
    assert len(notes) == 1 and str(path) in notes[0] and "150000 bytes" in notes[0]
    path.write_bytes(b'{"id": "on')  # only a fragment: nothing shows it is a results file, so nothing is cut
    with pytest.raises(ValueError, match="no whole record comes before it"):
        repair_torn_tail(path)
    assert path.read_bytes() == b'{"id": "on'


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"#!/bin/sh\necho hi", b'{"id": "a", "gear_id": "g"}\nnot json\n{"id": "b'],
                         ids=["binary", "script", "garbage-line-before"])
def test_repair_refuses_a_file_that_is_not_json_lines(tmp_path, content):
    """``--out`` pointing at the wrong file: refused with the reason, not a byte cut."""
    path = tmp_path / "not-results.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a flexpipe results file"):
        repair_torn_tail(path)
    assert path.read_bytes() == content


def test_sink_repairs_the_tail_before_appending(tmp_path):
    """Appending after a torn line would glue the next record onto it: both lost for good."""
    path = tmp_path / "r.jsonl"
    first, second = {"id": "1", "gear_id": "g", "x": 1}, {"id": "2", "gear_id": "g", "x": 2}
    path.write_text(json.dumps(first) + '\n{"id": "2", "x"', encoding="utf-8")  # a crash cut the second write
    notes: list[str] = []
    sink = JsonlSink(path, on_note=notes.append)
    assert sink.done_ids() == {"1"} and sink.torn_tail_bytes == len('{"id": "2", "x"') and notes == []
    sink.write(second)
    assert sink.repaired_bytes == len('{"id": "2", "x"')
    assert [json.loads(line) for line in path.read_text().splitlines()] == [first, second]
    assert len(notes) == 1 and f"results file {path}" in notes[0]


def test_torn_results_file_resumes_to_one_line_per_request(tmp_path, capsys):
    """The CLI resumes a results file whose last line is torn: the fragment is gone, stderr says so
    (file, bytes), and the request it held is served, so every request has exactly one valid line."""
    from flexpipe_dag.cli import main

    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    ids = _prompts(prompts, 4)
    done = [{"id": rid, "gear_id": "earlier-run", "output_token_ids": [42], "output_tokens": 1} for rid in ids[:3]]
    fragment = json.dumps({"id": ids[3], "gear_id": "earlier-run", "output_token_ids": [1, 2, 3]})[:25]
    out.write_text("".join(json.dumps(row) + "\n" for row in done) + fragment, encoding="utf-8")
    code = main(["run", "--stages", "2", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert re.search(rf"results file {re.escape(str(out))}: dropped a torn last line \({len(fragment)} bytes", err), err
    rows = _lines(out)  # every line a whole object: the fragment is gone, nothing was glued onto it
    assert out.read_text().startswith("".join(json.dumps(row) + "\n" for row in done))
    assert [row["id"] for row in rows] == ids  # the earlier three kept, the torn one served again
    assert rows[3]["gear_id"] != "earlier-run" and rows[3]["output_tokens"] >= 1


# -- signals ----------------------------------------------------------------------------------------
def _run_tree(pid: int) -> set[tuple[int, float]]:
    """(pid, create time) of ``pid``'s descendants now (the forkserver and resource tracker, and the
    driver and stage workers the forkserver forked)."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    tree = set()
    for k in kids:
        try:
            tree.add((k.pid, k.create_time()))
        except psutil.NoSuchProcess:
            continue
    return tree


def _alive(procs: set[tuple[int, float]]) -> list[str]:
    """The ones still running (a zombie, or a new process that reused the pid, counts as gone)."""
    left = []
    for pid, created in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left


def _signal_mid_run(tmp_path: Path, sig: signal.Signals) -> dict:
    """Start a 3-stage run of :data:`NUM_REQUESTS` requests in its own session, record every process
    under its head, send ``sig`` once a result is in (the others in flight: Ctrl-C as a terminal
    sends it, to the whole process group; any other signal to the head alone), and wait until the
    head and everything recorded is gone or :data:`GONE_WITHIN_S` passed."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    ids = _prompts(prompts)
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        head = subprocess.Popen(_command(prompts, out), env=_env(), stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
                                start_new_session=True)
    tree: set[tuple[int, float]] = set()
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (out.is_file() and out.read_text().count("\n") >= 1):
            assert head.poll() is None, f"the run ended before the signal: {err_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no result within {RUN_TIMEOUT_S} s: {err_path.read_text()[-3000:]}"
            tree |= _run_tree(head.pid)
            time.sleep(0.05)
        tree |= _run_tree(head.pid)
        assert len(tree) >= 4, f"expected the driver and 3 stage workers among the run's processes, got {tree}"
        t_signal = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(head.pid, sig)
        else:
            os.kill(head.pid, sig)
        code = head.wait(timeout=GONE_WITHIN_S)
        exit_s = time.monotonic() - t_signal
        while _alive(tree) and time.monotonic() - t_signal < GONE_WITHIN_S:
            time.sleep(0.1)
        gone_s = time.monotonic() - t_signal
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    left = _alive(tree)
    assert not left, f"{len(left)} of the run's {len(tree)} child processes alive {GONE_WITHIN_S} s after {sig.name}: {left}"
    print(f"{sig.name}: head exited {code} after {exit_s:.2f} s, every process of the run gone {gone_s:.2f} s "
          f"after the signal")
    return {"code": code, "stderr": err_path.read_text(), "prompts": prompts, "out": out, "ids": ids}


def _resume(run: dict, kept: int) -> None:
    """Re-running the same command serves only what is missing: one valid line per request."""
    rerun = subprocess.run(_command(run["prompts"], run["out"]), env=_env(), capture_output=True, text=True, cwd=REPO,
                           timeout=RUN_TIMEOUT_S)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["skipped_done"] == kept and summary["finished"] == NUM_REQUESTS - kept, summary
    _one_line_per_request(run["out"], run["ids"])


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_ends_every_process_keeps_results_and_resumes(tmp_path, sig, status):
    run = _signal_mid_run(tmp_path, sig)
    stderr, out = run["stderr"], run["out"]
    assert run["code"] == status, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    match = re.fullmatch(rf"flexpipe run: stopped by {sig.name} after (\d+) of {NUM_REQUESTS} requests \((\d+) in "
                         rf"this run\); (\d+) results in {re.escape(str(out))}; re-run the same command to resume", last)
    assert match, f"last stderr line: {last!r}"
    kept = _lines(out)
    assert int(match.group(1)) == int(match.group(2)) == int(match.group(3)) == len(kept) >= 1
    assert len({row["id"] for row in kept}) == len(kept) < NUM_REQUESTS
    _resume(run, len(kept))


def test_killed_head_takes_its_processes_with_it(tmp_path):
    """SIGKILL (the OOM killer, a hard-terminated Dagster run) runs no handler in the head: the
    driver and stage workers notice their parent is gone and exit, and the forkserver and resource
    tracker follow; the re-run repairs a torn tail if the kill cut a write, and resumes."""
    run = _signal_mid_run(tmp_path, signal.SIGKILL)
    assert run["code"] == -signal.SIGKILL
    repair_torn_tail(run["out"])  # what the re-run does at its first append: a torn last line is cut away
    kept = _lines(run["out"])
    assert 1 <= len(kept) < NUM_REQUESTS
    _resume(run, len(kept))


def test_interrupted_runtime_block_kills_its_processes_at_once():
    """A terminated Dagster run interrupts the op with ``DagsterExecutionInterruptedError`` (as
    Ctrl-C raises ``KeyboardInterrupt``): leaving the runtime's ``with`` block that way kills the
    driver and stage workers at once instead of draining them."""
    from dagster import DagsterExecutionInterruptedError

    from flexpipe_dag.runtime.pipeline import PipelineRuntime
    from tests.test_runtime_helpers import gear, requests

    runtime = PipelineRuntime(gear([(0, 15), (15, 30)]), checkpoint())
    with pytest.raises(DagsterExecutionInterruptedError):
        with runtime:
            workers = [psutil.Process(pid) for pid in runtime.stage_pids()]
            run = {(p.pid, p.create_time()) for w in workers for p in w.parent().children()}  # driver + workers
            runtime.submit(requests(4, prefix="interrupted-"))
            t0 = time.monotonic()
            raise DagsterExecutionInterruptedError("the run was terminated")
    left = _alive(run)
    assert len(run) == 3 and not left, f"alive after the interrupted block: {left}"
    assert time.monotonic() - t0 < 3.0


def test_stop_line_names_a_results_file_not_yet_created_and_the_workers_to_restart(tmp_path):
    from flexpipe_dag.cli.run import HeadState, stop_line
    from flexpipe_dag.runtime.results_file import JsonlSink

    out = tmp_path / "out.jsonl"
    state = HeadState(sink=JsonlSink(out), request_ids={"a", "b"})
    line = stop_line("stopped by SIGINT", out, state, remote=True)
    assert "no results yet" in line and "not created" in line and "start its workers again to resume" in line, line
    assert "results in" not in line and not out.exists()
    assert "start its workers" not in stop_line("stopped by SIGINT", out, state)
    assert "unchanged" in stop_line("stopped by SIGTERM", out, HeadState())
