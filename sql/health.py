"""Health tags in the store: gears marked unhealthy after a failure."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult, select, update

from flexpipe_dag.core.status import HealthFailure, checked
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase


class HealthTags(StoreBase):
    """Gears tagged unhealthy after a failure, until a profile refresh or model change clears them
    (table ``health_tags``).

    Raises:
        InputError: :meth:`mark_unhealthy` with a ``failure`` that is not a
            :class:`~flexpipe_dag.core.status.HealthFailure` (nothing is written).
    """

    def mark_unhealthy(self, gear_key: str, cluster_key: str, model_name: str, failure: str, reason: str,
                       run_key: str | None = None) -> int:
        """Tag a gear unhealthy after a failure (OOM, timeout, crashed stage); return the tag id."""
        failure = checked(HealthFailure, failure, "health_tags", "failure").value
        with self.session() as s:
            tag = m.HealthTag(gear_key=gear_key, cluster_key=cluster_key, model_name=model_name,
                              failure=failure, reason=reason, run_key=run_key)
            s.add(tag)
            s.flush()
            return tag.id

    def unhealthy_gear_keys(self, cluster_key: str | None = None, model_name: str | None = None) -> set[str]:
        """Keys of gears with an uncleared health tag."""
        with self.session() as s:
            q = select(m.HealthTag.gear_key).where(m.HealthTag.cleared_at.is_(None))
            if cluster_key is not None:
                q = q.where(m.HealthTag.cluster_key == cluster_key)
            if model_name is not None:
                q = q.where(m.HealthTag.model_name == model_name)
            return set(s.scalars(q))

    def health_tags(self, include_cleared: bool = False) -> list[m.HealthTag]:
        """Health tags, oldest first (only the open ones unless ``include_cleared``)."""
        with self.session() as s:
            q = select(m.HealthTag).order_by(m.HealthTag.id)
            if not include_cleared:
                q = q.where(m.HealthTag.cleared_at.is_(None))
            return list(s.scalars(q))

    def clear_health(self, reason: str, cluster_key: str | None = None, model_name: str | None = None) -> int:
        """Clear open health tags (profile refreshed / model changed); return how many were cleared."""
        with self.session() as s:
            q = update(m.HealthTag).where(m.HealthTag.cleared_at.is_(None))
            if cluster_key is not None:
                q = q.where(m.HealthTag.cluster_key == cluster_key)
            if model_name is not None:
                q = q.where(m.HealthTag.model_name == model_name)
            # an UPDATE executes to a CursorResult (the one that has rowcount); Session.execute is typed Result
            result = cast(CursorResult[Any], s.execute(q.values(cleared_at=m.utcnow(), cleared_reason=reason)))
            return result.rowcount
