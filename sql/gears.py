"""Model profiles and planned gears in the store."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select

from flexpipe_dag.core.gear import Gear
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase, finite_or_none, next_number


def spec_hash(spec: dict[str, Any]) -> str:
    """Stable SHA-256 of a JSON-able spec (sorted keys)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


class Gears(StoreBase):
    """Model profiles (table ``models``, one row per name, dtype and spec) and the gears planned for a
    profile version and model, in plan versions (tables ``gears``, ``gear_stages``).

    Raises:
        sqlalchemy.exc.IntegrityError: a gear names a profile version or model that is not stored
            (nothing of the plan is written).
    """

    def save_model(self, name: str, dtype: str, num_layers: int, spec: dict[str, Any]) -> int:
        """Store a model profile once per (name, dtype, spec); return its id."""
        digest = spec_hash(spec)
        with self.session() as s:
            row = s.scalar(select(m.ModelRow).where(m.ModelRow.name == name, m.ModelRow.dtype == dtype,
                                                    m.ModelRow.spec_hash == digest))
            if row is None:
                row = m.ModelRow(name=name, dtype=dtype, spec_hash=digest, num_layers=num_layers, spec=spec)
                s.add(row)
                s.flush()
            return row.id

    def model_ids(self, name: str) -> set[int]:
        """Ids of every stored version of model ``name``."""
        with self.session() as s:
            return set(s.scalars(select(m.ModelRow.id).where(m.ModelRow.name == name)))

    def save_gears(self, gears: Iterable[Gear], profile_version_id: int, model_id: int) -> list[int]:
        """Store gears planned together for a profile version and model as its next plan version.

        The newest plan version is the current candidate set (:meth:`load_gears`); earlier gears stay
        loadable by key (:meth:`load_gear`), e.g. the one still serving. Re-planning a gear with the
        same key moves it into the new plan version. Returns the row ids. Concurrent planners of the same
        profile version each get their own plan version.
        """
        ids = []
        with self.session() as s:
            parent = s.get(m.ProfileVersion, profile_version_id)
            plan_version = next_number(s, m.GearRow.plan_version, parent, m.GearRow.profile_version_id == profile_version_id,
                                       m.GearRow.model_id == model_id) if parent is not None else 1
            for gear in gears:
                old = s.scalar(select(m.GearRow).where(m.GearRow.gear_key == gear.gear_id,
                                                       m.GearRow.profile_version_id == profile_version_id,
                                                       m.GearRow.model_id == model_id))
                if old is not None:
                    s.delete(old)
                    s.flush()
                row = m.GearRow(
                    gear_key=gear.gear_id, profile_version_id=profile_version_id, model_id=model_id,
                    plan_version=plan_version, kind=gear.kind, micro_batch_size=gear.micro_batch_size,
                    max_inflight_micro_batches=gear.max_inflight_micro_batches,
                    kv_capacity_tokens=gear.kv_capacity_tokens, rps_min=gear.rps_min,
                    rps_max=finite_or_none(gear.rps_max), target_p99_ms=gear.target_p99_ms,
                    estimate=gear.estimate.model_dump() if gear.estimate else None,
                    spec=gear.model_dump(mode="json"),
                    stages=[m.GearStageRow(stage_index=st.stage_index, layer_start=st.layer_start,
                                           layer_end=st.layer_end, device_keys=list(st.device_ids),
                                           est_stage_ms=st.est_stage_ms, weight_gib=st.weight_gib,
                                           kv_capacity_tokens=st.kv_capacity_tokens)
                            for st in gear.stages],
                )
                s.add(row)
                s.flush()
                ids.append(row.id)
        return ids

    def load_gears(self, profile_version_id: int | None = None, model_id: int | None = None,
                   current_only: bool = True) -> list[Gear]:
        """Gears stored for a profile version and/or model, in insertion order.

        ``current_only``: per (profile version, model), only the newest plan version (the current
        candidate set); False returns every stored gear.
        """
        with self.session() as s:
            q = select(m.GearRow).order_by(m.GearRow.id)
            if profile_version_id is not None:
                q = q.where(m.GearRow.profile_version_id == profile_version_id)
            if model_id is not None:
                q = q.where(m.GearRow.model_id == model_id)
            rows = list(s.scalars(q))
            if current_only:
                newest: dict[tuple[int, int], int] = {}
                for r in rows:
                    key = (r.profile_version_id, r.model_id)
                    newest[key] = max(newest.get(key, 0), r.plan_version)
                rows = [r for r in rows if r.plan_version == newest[(r.profile_version_id, r.model_id)]]
            return [Gear.model_validate(r.spec) for r in rows]

    def load_gear(self, gear_key: str) -> Gear | None:
        """The most recently stored gear with this key, or None."""
        with self.session() as s:
            row = s.scalar(select(m.GearRow).where(m.GearRow.gear_key == gear_key).order_by(m.GearRow.id.desc()))
            return Gear.model_validate(row.spec) if row else None
