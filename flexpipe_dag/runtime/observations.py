"""Per-step stage observations of the live runtime: what each stage computed and how long it took.

Every stage worker writes one row per micro-batch step into a fixed-size ring of ``float64`` rows in
a memory-mapped file (:class:`StepRecorder`; no message, no lock, a few stores per step). The
parent opens each stage's ring from the path the worker reports in its stage info
(``worker_infos[w].observations_path``) and turns new rows into
:class:`~flexpipe_dag.calibration.observation.StageObservation` objects
(:class:`ObservationCollector`), which the calibration fits and the store keeps.

Ring layout: row 0 is the header ``[rows_written, capacity, num_columns, format_version]``;
row ``1 + (i mod capacity)`` holds step ``i``. The writer fills a row, then bumps ``rows_written``,
so a reader never sees a half-written row; a reader that falls more than ``capacity`` rows behind
counts the overwritten rows as ``dropped``. The worker unlinks its file on exit (a new worker sweeps
away the files of killed ones); a reader that opened it before keeps its mapping (POSIX), so open the
collector right after
:meth:`~flexpipe_dag.runtime.pipeline.PipelineRuntime.start`.

What a row holds (columns :data:`COLUMNS`): the micro-batch id, the step's end on the worker's
monotonic clock, compute wall time (forward + sampling on the last stage, ms), the sequences and
their new tokens split into prefill (whole prompts) and decode (one token after a cached prefix),
the KV tokens the attention read and the query-key pairs it scored, the stage's layer range, and
the time the stage spent handing its activations to the next stage (sender side, ``send_ms``; NaN
on the last stage) with their size in bytes.
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np

from flexpipe_dag.runtime.messages import StageInfo

#: Column names of one ring row, in order.
COLUMNS: tuple[str, ...] = ("mb_id", "t_end_s", "wall_ms", "num_seqs", "prefill_seqs", "prompt_tokens",
                            "decode_tokens", "kv_context_tokens", "attended_pairs", "layer_start", "layer_end",
                            "send_ms", "send_bytes", "reserved0", "reserved1", "reserved2")
NUM_COLUMNS = len(COLUMNS)
FORMAT_VERSION = 1
#: Rows kept per stage (about 2 MiB); a reader must collect at least this often (in steps).
DEFAULT_CAPACITY = 16384
_C = {name: i for i, name in enumerate(COLUMNS)}


def observations_dir() -> Path:
    """Directory of the ring files (under the system temporary directory; files vanish with their worker)."""
    d = Path(tempfile.gettempdir()) / "flexpipe-observations"
    d.mkdir(parents=True, exist_ok=True)
    return d


def micro_batch_counts(seqs) -> tuple[int, int, int, int, int, int]:
    """Work counts of one micro-batch's sequences (objects with ``token_ids`` and ``start_pos``).

    Returns:
        ``(num_seqs, prefill_seqs, prompt_tokens, decode_tokens, kv_context_tokens, attended_pairs)``:
        a sequence with one new token after a cached prefix is a decode, any other a prefill; KV
        context = cached + new tokens per sequence, summed; attended pairs = for each new token the
        keys it sees (``n p + n (n + 1) / 2`` for ``n`` new tokens after ``p`` cached).
    """
    prefill_seqs = prompt_tokens = decode_tokens = kv_context = pairs = 0
    for s in seqs:
        n, p = len(s.token_ids), int(s.start_pos)
        if n == 1 and p > 0:
            decode_tokens += 1
        else:
            prefill_seqs += 1
            prompt_tokens += n
        kv_context += p + n
        pairs += n * p + n * (n + 1) // 2
    return len(seqs), prefill_seqs, prompt_tokens, decode_tokens, kv_context, pairs


def sweep_stale_rings(directory: str | os.PathLike | None = None) -> int:
    """Remove ring files whose worker process is gone (a killed worker cannot unlink its own); returns how many."""
    d = Path(directory) if directory is not None else observations_dir()
    removed = 0
    for f in d.glob("stage*-*-*.f64"):
        try:
            pid = int(f.name.split("-")[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            f.unlink(missing_ok=True)
            removed += 1
        except (ValueError, IndexError, PermissionError, OSError):
            continue
    return removed


class StepRecorder:
    """Writer side of one stage's ring (runs in the stage worker).

    Usage per step: :meth:`begin` (after the forward), optionally :meth:`set_send` (after handing the
    activations on), then :meth:`commit`; or :meth:`commit` first and :meth:`set_send_at` once a
    background sender has handed the activations on.

    Args:
        stage: the stage index (names the file).
        capacity: rows kept.
        directory: where the file goes (default :func:`observations_dir`).
    """

    def __init__(self, stage: int, capacity: int = DEFAULT_CAPACITY, directory: str | os.PathLike | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        d = Path(directory) if directory is not None else observations_dir()
        sweep_stale_rings(d)
        self.path = str(d / f"stage{stage}-{os.getpid()}-{uuid.uuid4().hex[:8]}.f64")
        self._ring: np.memmap | None = np.memmap(self.path, dtype="<f8", mode="w+", shape=(capacity + 1, NUM_COLUMNS))
        self._ring[0, :4] = (0, capacity, NUM_COLUMNS, FORMAT_VERSION)
        self.capacity = capacity
        self._written = 0
        self._row: np.ndarray | None = None

    def begin(self, mb_id: int, seqs, layer_start: int, layer_end: int, wall_ms: float, t_end_s: float) -> None:
        """Fill the next row (not yet visible to readers) with one step's counts and compute time.

        Raises:
            ValueError: the recorder was closed.
        """
        row = self._open_ring()[1 + self._written % self.capacity]
        row[:] = math.nan
        counts = micro_batch_counts(seqs)
        row[_C["mb_id"]], row[_C["t_end_s"]], row[_C["wall_ms"]] = mb_id, t_end_s, wall_ms
        row[_C["num_seqs"]:_C["attended_pairs"] + 1] = counts
        row[_C["layer_start"]], row[_C["layer_end"]] = layer_start, layer_end
        row[_C["send_bytes"]] = 0.0
        self._row = row

    def set_send(self, send_ms: float, send_bytes: int) -> None:
        """Record the hand-off of this step's activations to the next stage (sender side)."""
        if self._row is not None:
            self._row[_C["send_ms"]], self._row[_C["send_bytes"]] = send_ms, send_bytes

    def set_send_at(self, row: int, send_ms: float, send_bytes: int) -> None:
        """Record the hand-off of a committed row's activations (``row`` as :meth:`commit` returned it),
        from the thread that sent them; a row the ring has since reused is left alone."""
        if self._written - row > self.capacity - 1:
            return
        ring = self._open_ring()
        ring[1 + row % self.capacity, _C["send_ms"]] = send_ms
        ring[1 + row % self.capacity, _C["send_bytes"]] = send_bytes

    def commit(self) -> int | None:
        """Make the row visible to readers; returns its number (for :meth:`set_send_at`), None without one."""
        if self._row is None:
            return None
        row = self._written
        self._written += 1
        self._open_ring()[0, 0] = self._written
        self._row = None
        return row

    def _open_ring(self) -> np.memmap:
        if self._ring is None:
            raise ValueError(f"{self.path}: the step recorder is closed")
        return self._ring

    def close(self, unlink: bool = True) -> None:
        """Flush and (by default) remove the file; readers that opened it keep their mapping."""
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.flush()
            del ring
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class RingReader:
    """Reader side of one ring file: :meth:`read_new` returns the rows written since the last call.

    Raises:
        FileNotFoundError: the file is gone (its worker exited before the reader opened it).
        ValueError: the file is not a ring of this format.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        raw = np.memmap(self.path, dtype="<f8", mode="r")
        if raw.size < NUM_COLUMNS or raw.size % NUM_COLUMNS:
            raise ValueError(f"{self.path}: not an observation ring ({raw.size} values)")
        self._ring = raw.reshape(-1, NUM_COLUMNS)
        capacity, ncol, version = (int(x) for x in self._ring[0, 1:4])
        if ncol != NUM_COLUMNS or version != FORMAT_VERSION or capacity != self._ring.shape[0] - 1:
            raise ValueError(f"{self.path}: ring header {self._ring[0, :4].tolist()} does not match format "
                             f"{FORMAT_VERSION} with {NUM_COLUMNS} columns")
        self.capacity = capacity
        self.read = 0
        self.dropped = 0

    def read_new(self) -> np.ndarray:
        """``(n, NUM_COLUMNS)`` copy of the rows committed since the last call, oldest first."""
        written = int(self._ring[0, 0])
        start = self.read
        if written - start > self.capacity:
            self.dropped += written - start - self.capacity
            start = written - self.capacity
        idx = 1 + np.arange(start, written) % self.capacity
        rows = np.array(self._ring[idx])
        self.read = written
        return rows


def rows_to_dicts(rows: np.ndarray) -> list[dict[str, float]]:
    """Ring rows as ``{column: value}`` dicts (reserved columns left out)."""
    keep = [c for c in COLUMNS if not c.startswith("reserved")]
    return [{c: float(r[_C[c]]) for c in keep} for r in rows]


class ObservationCollector:
    """Collects a running pipeline's per-step observations in the parent process.

    Args:
        runtime: a started :class:`~flexpipe_dag.runtime.pipeline.PipelineRuntime` (its ``gear``
            names each stage's device; its ``worker_infos``, :class:`~flexpipe_dag.runtime.messages.StageInfo`
            per worker, the ring files).
        run_key: written into nothing here; kept for the caller's store writes.

    Raises:
        ValueError: a stage reported no ring file (a worker without observation support).
    """

    def __init__(self, runtime, run_key: str | None = None):
        self.runtime = runtime
        self.run_key = run_key
        self._readers: list = []
        remote = getattr(runtime, "remote_stages", None)
        if remote:  # stages on other hosts ship their rows to the head (flexpipe_dag.runtime.remote)
            self._readers = list(remote)
        infos: list[StageInfo] = runtime.worker_infos
        for info in [] if remote else infos:
            if not info.observations_path:
                raise ValueError(f"stage {info.stage_index} reported no observations_path")
            self._readers.append(RingReader(info.observations_path))
        self.observations: list = []
        self._t0: float | None = None

    @property
    def dropped(self) -> int:
        """Rows overwritten before they were collected (collect more often if non-zero)."""
        return sum(r.dropped for r in self._readers)

    def collect(self) -> list:
        """New :class:`~flexpipe_dag.calibration.observation.StageObservation` objects of every stage.

        ``t_s`` is seconds since the first step this collector saw; each stage is attributed to the
        runtime's current gear (collect before a reconfiguration to keep the old gear's rows apart).
        """
        from flexpipe_dag.calibration.observation import StageObservation, kind_of

        gear = self.runtime.gear
        n = gear.num_stages
        new = []
        per_stage = [r.read_new() for r in self._readers]
        if self._t0 is None:
            starts = [rows[0, _C["t_end_s"]] - rows[0, _C["wall_ms"]] / 1e3 for rows in per_stage if len(rows)]
            if starts:
                self._t0 = min(starts)
        for info, rows in zip(self.runtime.worker_infos, per_stage):  # one ring per worker (stage replica)
            s, k = info.slot
            dev = gear.stages[s].device_ids[k % len(gear.stages[s].device_ids)]
            dst = None
            if s + 1 < n:  # the next stage's replica on this replica's first lane
                nxt = gear.stages[s + 1].device_ids
                dst = nxt[k % len(nxt)]
            for r in rows:
                send_ms = float(r[_C["send_ms"]])
                prefill_seqs, decode_tokens = int(r[_C["prefill_seqs"]]), int(r[_C["decode_tokens"]])
                new.append(StageObservation(
                    gear_id=gear.gear_id, stage_index=s, device_id=dev, is_first=s == 0, is_last=s == n - 1,
                    layer_start=int(r[_C["layer_start"]]), layer_end=int(r[_C["layer_end"]]),
                    kind=kind_of(prefill_seqs, decode_tokens), num_seqs=int(r[_C["num_seqs"]]),
                    prefill_seqs=prefill_seqs, prompt_tokens=int(r[_C["prompt_tokens"]]),
                    decode_tokens=decode_tokens, kv_context_tokens=int(r[_C["kv_context_tokens"]]),
                    attended_pairs=int(r[_C["attended_pairs"]]), wall_ms=float(r[_C["wall_ms"]]),
                    send_ms=None if math.isnan(send_ms) else send_ms, send_bytes=int(r[_C["send_bytes"]]),
                    dst_device_id=dst, mb_id=int(r[_C["mb_id"]]),
                    t_s=float(r[_C["t_end_s"]]) - (self._t0 or 0.0)))
        new.sort(key=lambda o: (o.t_s, o.stage_index))
        self.observations.extend(new)
        return new
