"""The per-step observation ring (runtime side, no processes): counts, commit visibility, wrap-around, sweep."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from flexpipe_dag.runtime.observations import (
    RingReader,
    StepRecorder,
    micro_batch_counts,
    rows_to_dicts,
    sweep_stale_rings,
)


def seq(n, p):
    return SimpleNamespace(token_ids=[0] * n, start_pos=p)


def test_micro_batch_counts():
    # a 5-token prompt, a 1-token prompt, two decodes after 7 and 9 cached tokens
    assert micro_batch_counts([seq(5, 0), seq(1, 0), seq(1, 7), seq(1, 9)]) == (4, 2, 6, 2, 5 + 1 + 8 + 10,
                                                                                  15 + 1 + 8 + 10)


def test_ring_commit_wrap_and_unlink(tmp_path):
    rec = StepRecorder(0, capacity=4, directory=tmp_path)
    reader = RingReader(rec.path)
    rec.begin(1, [seq(3, 0)], 0, 10, 12.5, 100.0)
    assert len(reader.read_new()) == 0  # not committed yet
    rec.set_send(0.5, 4096)
    rec.commit()
    (row,) = rows_to_dicts(reader.read_new())
    assert (row["mb_id"], row["wall_ms"], row["prompt_tokens"], row["layer_end"], row["send_bytes"]) == (1, 12.5, 3, 10, 4096)
    for i in range(2, 9):
        rec.begin(i, [seq(1, 5)], 0, 10, 1.0, 100.0 + i)
        rec.commit()
    rows = rows_to_dicts(reader.read_new())
    assert [r["mb_id"] for r in rows] == [5, 6, 7, 8] and reader.dropped == 3  # only the newest 4 are kept
    rec.close()
    assert not os.path.exists(rec.path)
    assert len(reader.read_new()) == 0  # the reader's mapping outlives the file


def test_sweep_removes_rings_of_dead_workers(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60)
    stale = tmp_path / f"stage0-{int(dead.stdout)}-deadbeef.f64"
    stale.write_bytes(b"\0" * 128)
    live = tmp_path / f"stage1-{os.getpid()}-cafecafe.f64"
    live.write_bytes(b"\0" * 128)
    assert sweep_stale_rings(tmp_path) == 1
    assert not stale.exists() and live.exists()
    with pytest.raises(ValueError):
        RingReader(live)


def test_recorder_refuses_a_step_after_close(tmp_path):
    rec = StepRecorder(0, capacity=4, directory=tmp_path)
    rec.close()
    with pytest.raises(ValueError, match="closed"):
        rec.begin(1, [seq(3, 0)], 0, 10, 12.5, 100.0)
