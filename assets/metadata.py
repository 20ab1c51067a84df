"""Helpers that turn FlexPipe objects into Dagster metadata a user can read in the UI."""

from __future__ import annotations

import base64
from pathlib import Path

import pandas as pd
from dagster import MetadataValue

from flexpipe_dag.core.settings import flexpipe_home


def png_metadata(png: bytes, name: str) -> dict[str, MetadataValue]:
    """A PNG as two metadata entries: an inline markdown image and the file's path under FLEXPIPE_HOME."""
    out_dir = flexpipe_home() / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = Path(out_dir, f"{name}.png")
    path.write_bytes(png)
    data = base64.b64encode(png).decode()
    return {name: MetadataValue.md(f"![{name}](data:image/png;base64,{data})"),
            f"{name}_path": MetadataValue.path(str(path))}


def table_metadata(frame: pd.DataFrame) -> MetadataValue:
    """A DataFrame as a markdown table (floats to 4 significant digits)."""
    return MetadataValue.md(frame.to_markdown(index=False, floatfmt=".4g"))


def latest_profile_or_fail(db):
    """``(ProfileVersionInfo, ClusterProfile)`` of the newest stored profile; InfeasibleError if none."""
    from flexpipe_dag.core.errors import InfeasibleError

    latest = db.latest_profile()
    if latest is None:
        raise InfeasibleError("no cluster profile stored yet: materialise gpu_profile first")
    return latest


def cluster_for_run(cluster_file: str, store):
    """The ``ClusterProfile`` of a run config's ``cluster_file``, else the newest stored one (``store``: the
    store resource); InputError for a bad file, InfeasibleError when neither is there."""
    from flexpipe_dag.core.cluster import load_cluster_profile

    if cluster_file:
        return load_cluster_profile(cluster_file)
    return latest_profile_or_fail(store.get_store())[1]
