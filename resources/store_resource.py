"""Dagster resource that hands out the FlexPipe SQL store."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import PrivateAttr

from flexpipe_dag.sql.store import Store


class StoreResource(ConfigurableResource):
    """The SQL store. ``database_url`` empty means ``FLEXPIPE_DATABASE_URL`` or SQLite under ``FLEXPIPE_HOME``."""

    database_url: str = ""
    _store: Store | None = PrivateAttr(default=None)

    def get_store(self) -> Store:
        """The store, migrated to head on first use."""
        if self._store is None:
            self._store = Store.from_url(self.database_url or None)
        return self._store
