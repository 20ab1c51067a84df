"""Stage observations and calibration versions in the store (runtime -> calibration -> planner).

``flexpipe_dag.calibration`` is imported lazily, where a row is turned into one of its objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, select

from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase, json_ready, next_number


class Observations(StoreBase):
    """Observed stage steps of runs (table ``stage_observations``, raw evidence, never updated) and
    the calibration versions fitted from them beside a profile version (table ``calibrations``).

    Raises:
        KeyError: :meth:`save_calibration` for a profile version that is not stored.
    """

    _OBS_FIELDS = ("stage_index", "is_first", "is_last", "layer_start", "layer_end", "kind", "num_seqs",
                   "prefill_seqs", "prompt_tokens", "decode_tokens", "kv_context_tokens", "attended_pairs",
                   "wall_ms", "send_ms", "send_bytes", "mb_id", "t_s")

    def write_observations(self, run_key: str, observations: Iterable[Any], cluster_key: str | None = None) -> int:
        """Append observed stage steps (:class:`~flexpipe_dag.calibration.observation.StageObservation`) of a run."""
        def plain(f: str, v: Any) -> Any:  # numpy scalars -> Python (psycopg2 cannot adapt them)
            if v is None or f == "kind":
                return v
            if f in ("is_first", "is_last"):
                return bool(v)
            return float(v) if f in ("wall_ms", "send_ms", "t_s") else int(v)

        rows = [m.StageObservationRow(run_key=run_key, gear_key=o.gear_id, cluster_key=cluster_key,
                                      device_key=o.device_id, dst_device_key=o.dst_device_id,
                                      **{f: plain(f, getattr(o, f)) for f in self._OBS_FIELDS})
                for o in observations]
        with self.session() as s:
            s.add_all(rows)
        return len(rows)

    def read_observations(self, run_key: str | None = None, gear_key: str | None = None,
                          cluster_key: str | None = None) -> list[Any]:
        """Stored stage steps (oldest first), optionally of one run / gear / cluster, as ``StageObservation``."""
        from flexpipe_dag.calibration.observation import StageObservation

        q = select(m.StageObservationRow).order_by(m.StageObservationRow.id)
        if run_key is not None:
            q = q.where(m.StageObservationRow.run_key == run_key)
        if gear_key is not None:
            q = q.where(m.StageObservationRow.gear_key == gear_key)
        if cluster_key is not None:
            q = q.where(m.StageObservationRow.cluster_key == cluster_key)
        with self.session() as s:
            return [StageObservation(gear_id=r.gear_key, device_id=r.device_key, dst_device_id=r.dst_device_key,
                                     **{f: getattr(r, f) for f in self._OBS_FIELDS}) for r in s.scalars(q)]

    def observed_runs(self) -> list[dict[str, Any]]:
        """One row per (run, gear) with stored observations: ``run_key, gear_key, cluster_key, steps``."""
        r = m.StageObservationRow
        q = (select(r.run_key, r.gear_key, r.cluster_key, func.count(r.id), func.min(r.id))
             .group_by(r.run_key, r.gear_key, r.cluster_key).order_by(func.min(r.id)))
        with self.session() as s:
            return [{"run_key": a, "gear_key": b, "cluster_key": c, "steps": n} for a, b, c, n, _ in s.execute(q)]

    def save_calibration(self, profile_version_id: int, calibration: Any, run_keys: Iterable[str] = ()) -> tuple[int, int]:
        """Store a :class:`~flexpipe_dag.calibration.Calibration` as the next calibration version of a
        profile version (the profile's device and link rows are not touched); returns ``(id, version)``.

        Raises:
            KeyError: no such profile version.
        """
        with self.session() as s:
            parent = s.get(m.ProfileVersion, profile_version_id)
            if parent is None:
                raise KeyError(profile_version_id)
            version = next_number(s, m.CalibrationRow.version, parent,
                                  m.CalibrationRow.profile_version_id == profile_version_id)
            row = m.CalibrationRow(profile_version_id=profile_version_id, version=version,
                                   model_name=calibration.model_name, dtype=calibration.dtype,
                                   num_observations=calibration.num_observations, run_keys=list(run_keys),
                                   changed_devices=calibration.changed_devices(), summary=calibration.summary_lines(),
                                   document=json_ready(calibration.to_dict()))
            s.add(row)
            s.flush()
            return row.id, row.version

    def calibrations(self, profile_version_id: int | None = None) -> list[m.CalibrationRow]:
        """Stored calibration rows, oldest first (optionally of one profile version)."""
        q = select(m.CalibrationRow).order_by(m.CalibrationRow.id)
        if profile_version_id is not None:
            q = q.where(m.CalibrationRow.profile_version_id == profile_version_id)
        with self.session() as s:
            return list(s.scalars(q))

    def latest_calibration(self, profile_version_id: int, model_name: str | None = None,
                           dtype: str | None = None) -> Any | None:
        """The newest :class:`~flexpipe_dag.calibration.Calibration` of a profile version (or ``None``)."""
        from flexpipe_dag.calibration.calibrate import Calibration

        q = (select(m.CalibrationRow).where(m.CalibrationRow.profile_version_id == profile_version_id)
             .order_by(m.CalibrationRow.version.desc()).limit(1))
        if model_name is not None:
            q = q.where(m.CalibrationRow.model_name == model_name)
        if dtype is not None:
            q = q.where(m.CalibrationRow.dtype == dtype)
        with self.session() as s:
            row = s.scalar(q)
            return None if row is None else Calibration.from_dict(row.document)
