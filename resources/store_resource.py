"""Dagster resource that hands out the FlexPipe SQL store."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr

from flexpipe_dag.sql.store import Store


class StoreResource(ConfigurableResource):
    """The SQL store. ``database_url`` empty means ``FLEXPIPE_DATABASE_URL`` or SQLite under ``FLEXPIPE_HOME``.

    Give a URL holding a password as ``dagster.EnvVar("FLEXPIPE_DATABASE_URL")``, never as a literal:
    Dagster keeps a literal in every run's job snapshot and shows it in the UI, while an ``EnvVar`` is
    stored by name and read in the run's process (:func:`flexpipe_dag.definitions.build_resources` does so).
    """

    database_url: str = Field(default="", description="SQLAlchemy URL of the store (give one holding a password as "
                              "an EnvVar); empty = FLEXPIPE_DATABASE_URL, else SQLite under FLEXPIPE_HOME")
    _store: Store | None = PrivateAttr(default=None)

    def get_store(self) -> Store:
        """The store, migrated to head on first use.

        Raises:
            InputError: the URL is bad or the store cannot be opened (password hidden in the message).
        """
        if self._store is None:
            self._store = Store.from_url(self.database_url.strip() or None)
        return self._store
