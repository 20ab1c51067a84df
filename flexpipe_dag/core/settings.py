"""Where FlexPipe keeps its state, from the environment.

* ``FLEXPIPE_HOME``: directory for the embedded SQLite store, cached model conversions and reports
  (default ``~/.flexpipe``).
* ``FLEXPIPE_MODEL_CACHE``: where converted model checkpoints are cached (default
  ``$FLEXPIPE_HOME/models``); several homes (e.g. test runs) can share one.
* ``FLEXPIPE_DATABASE_URL``: an SQLAlchemy URL (e.g. ``postgresql+psycopg2://user@host/db``); when
  set, the store uses it instead of SQLite.
"""

from __future__ import annotations

import os
from pathlib import Path


def flexpipe_home() -> Path:
    """The FlexPipe home directory (created if missing)."""
    home = Path(os.environ.get("FLEXPIPE_HOME") or Path.home() / ".flexpipe").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def database_url() -> str:
    """The store's SQLAlchemy URL: ``FLEXPIPE_DATABASE_URL`` or SQLite under :func:`flexpipe_home`."""
    return os.environ.get("FLEXPIPE_DATABASE_URL") or f"sqlite:///{flexpipe_home() / 'flexpipe.db'}"


def model_cache_dir() -> Path:
    """Directory of converted model checkpoints (``FLEXPIPE_MODEL_CACHE`` or ``$FLEXPIPE_HOME/models``)."""
    path = Path(os.environ.get("FLEXPIPE_MODEL_CACHE") or flexpipe_home() / "models").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path
