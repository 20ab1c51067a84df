"""Attacks on a run's results file (``--out``), issue #15 follow-up.

* the tail repair never erases a file a refused command named: a one-line JSON document without a
  newline (a gear), a file of bare ``\\r`` lines, a lone fragment are refused unchanged; a whole last
  record that lacks its newline is kept; the repair waits for the first append, so a command refused
  for its prompts leaves ``--out`` byte for byte as it was;
* ``--out`` naming a file that is not a results file (a config, a prompts file, one bad line in the
  middle), a symbolic link, a FIFO, a device or a directory is refused with one line, unchanged;
* the existing file is read line by line, not whole.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime import results_file
from flexpipe_dag.runtime.results_file import JsonlSink, scan_results


def _rec(rid: str, **extra) -> str:
    return json.dumps({"id": rid, "gear_id": "g", **extra})


def _refused(path: Path, needle: str) -> None:
    """Opening a sink on ``path`` is refused with one line holding ``needle``; ``path`` unchanged."""
    before = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    with pytest.raises(InputError) as info:
        JsonlSink(path)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)
    if before is not None:
        assert path.read_bytes() == before


# -- the repair keeps what is whole, and never cuts a file that is not results --------------------
def test_one_line_json_document_without_newline_is_refused_not_erased(tmp_path):
    gear = tmp_path / "gear.json"
    gear.write_text(json.dumps({"gear_id": "g1", "stages": [{"layer_start": 0, "layer_end": 30}], "pad": "x" * 1900}))
    _refused(gear, "JSON but not a result record")


def test_only_a_fragment_is_refused_not_cut(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(_rec("a").encode()[:12])
    _refused(path, "no whole record comes before it")


def test_bare_cr_line_endings_are_refused_not_cut(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(f"{_rec('a')}\r{_rec('b')}\r".encode())
    _refused(path, "bare carriage return")


def test_crlf_lines_are_read_and_a_whole_last_record_gets_its_newline(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(f"{_rec('a')}\r\n{_rec('b')}\r".encode())  # the last write stopped between \r and \n
    notes: list[str] = []
    sink = JsonlSink(path, on_note=notes.append)
    assert sink.done_ids() == {"a", "b"} and sink.torn_tail_bytes == 0
    sink.write(json.loads(_rec("c")))
    assert path.read_bytes() == f"{_rec('a')}\r\n{_rec('b')}\r\n{_rec('c')}\n".encode()
    assert len(notes) == 1 and "newline added" in notes[0]


def test_whole_last_record_without_newline_is_kept(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(f"{_rec('a')}\n{_rec('b')}")
    sink = JsonlSink(path)
    assert sink.done_ids() == {"a", "b"}
    sink.write(json.loads(_rec("b")))  # done: skipped, nothing written
    assert path.read_text() == f"{_rec('a')}\n{_rec('b')}"
    sink.write(json.loads(_rec("c")))
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b", "c"]
    assert sink.repaired_bytes == 0


def test_torn_tail_is_cut_at_the_first_append_not_at_open(tmp_path):
    path = tmp_path / "out.jsonl"
    content = f"{_rec('a')}\n{_rec('b')[:15]}".encode()
    path.write_bytes(content)
    notes: list[str] = []
    sink = JsonlSink(path, on_note=notes.append)
    assert sink.done_ids() == {"a"} and sink.torn_tail_bytes == 15
    assert path.read_bytes() == content and notes == []  # opened: nothing changed yet
    sink.write(json.loads(_rec("b")))
    assert path.read_text() == f"{_rec('a')}\n{_rec('b')}\n"
    assert sink.repaired_bytes == 15 and len(notes) == 1 and "15 bytes after byte" in notes[0]


def test_file_appended_to_after_open_is_scanned_again(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(f"{_rec('a')}\n")
    sink = JsonlSink(path)
    with open(path, "a") as fh:  # another writer finished 'b' and tore 'c'
        fh.write(f"{_rec('b')}\n{_rec('c')[:9]}")
    sink.write(json.loads(_rec("b")))  # the first write rescans: 'b' is done (not written twice), 'c' torn
    assert sink.done_ids() == {"a", "b"} and sink.repaired_bytes == 9
    sink.write(json.loads(_rec("c")))
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


# -- --out that is not a results file -------------------------------------------------------------
@pytest.mark.parametrize("content, needle", [
    (b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/:/usr/sbin/nologin\n", "line 1: not valid JSON"),
    (b'{"id": "a", "prompt": "hi"}\n', "line 1: JSON but not a result record"),  # a prompts file
    (f'{_rec("a")}\nnot json\n{_rec("b")}\n'.encode(), "line 2: not valid JSON"),
    (f'{_rec("a")}\n\n{_rec("b")}\n[1, 2]\n'.encode(), "line 4: JSON but not a result record"),
    (f'{_rec("a")}\n'.encode() + b'{"id": "\xff", "gear_id": "g"}\n', "line 2: not valid JSON"),
], ids=["passwd", "prompts", "bad-middle-line", "array-line", "not-utf8-line"])
def test_file_that_is_not_results_is_refused_unchanged(tmp_path, content, needle):
    path = tmp_path / "out.jsonl"
    path.write_bytes(content)
    _refused(path, needle)


def test_symlink_is_refused_even_to_a_results_file(tmp_path):
    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    target.write_text(f"{_rec('a')}\n")
    link.symlink_to(target)
    _refused(link, "is a symbolic link")
    assert target.read_text() == f"{_rec('a')}\n"


def test_symlink_planted_after_open_is_refused_at_write(tmp_path):
    path, victim = tmp_path / "out.jsonl", tmp_path / "important.conf"
    victim.write_text("key = value\n")
    sink = JsonlSink(path)  # missing: fine
    path.symlink_to(victim)
    with pytest.raises(InputError, match="is a symbolic link"):
        sink.write(json.loads(_rec("a")))
    assert victim.read_text() == "key = value\n"


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_special_files_are_refused(tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "out.jsonl"
        os.mkfifo(path)
        needle = "is a FIFO"
    elif kind == "device":
        path, needle = Path("/dev/null"), "is a device"
    else:
        path, needle = tmp_path, "is a directory"
    _refused(path, needle)


def test_over_long_line_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(results_file, "MAX_RESULT_LINE_BYTES", 100)
    path = tmp_path / "out.jsonl"
    path.write_text(f"{_rec('a')}\n{_rec('b', pad='x' * 200)}\n")
    _refused(path, "line 2: longer than")


# -- streaming --------------------------------------------------------------------------------------
def test_existing_file_is_read_line_by_line(tmp_path):
    """A 24 MB results file is scanned holding about one line at a time, not the whole file."""
    path = tmp_path / "out.jsonl"
    line = _rec("{}", pad="x" * 100_000)
    with open(path, "w") as fh:
        for i in range(240):
            fh.write(line.replace("{}", f"r{i}", 1) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        scan = scan_results(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert scan.records == 240 and len(scan.done_ids) == 240
    assert peak < size / 20, f"scan peaked at {peak} bytes for a {size}-byte file"


# -- the CLI ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, content, needle", [
    ("gear.json", json.dumps({"gear_id": "g1", "pad": "x" * 1900}).encode(), "--out"),
    ("out.jsonl", f"{_rec('a')}\n{_rec('b')[:20]}".encode(), "prompts file not found"),
], ids=["not-results", "torn-but-prompts-missing"])
def test_refused_command_leaves_out_unchanged(tmp_path, capsys, name, content, needle):
    """`flexpipe run --prompts missing.jsonl --out FILE` once erased FILE; now it exits 2 with one
    line and FILE byte for byte as it was (a torn tail waits for the first append)."""
    from flexpipe_dag.cli import main

    out = tmp_path / name
    out.write_bytes(content)
    code = main(["run", "--stages", "1", "--prompts", str(tmp_path / "nonexistent.jsonl"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert "dropped" not in err and out.read_bytes() == content
