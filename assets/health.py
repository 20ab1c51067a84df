"""The ``gear_health`` asset: which gears are tagged unhealthy (OOM, timeout, crashed stage, failed health check)."""

import pandas as pd
from dagster import AssetExecutionContext, MaterializeResult, asset

from flexpipe_dag.assets.metadata import table_metadata
from flexpipe_dag.resources.store_resource import StoreResource


def health_table(tags) -> pd.DataFrame:
    return pd.DataFrame([{
        "gear": t.gear_key, "cluster": t.cluster_key, "model": t.model_name, "failure": t.failure,
        "reason": t.reason, "since": t.created_at.isoformat(timespec="seconds"),
        "cleared": t.cleared_at.isoformat(timespec="seconds") if t.cleared_at else "",
        "cleared_reason": t.cleared_reason or "",
    } for t in tags], columns=["gear", "cluster", "model", "failure", "reason", "since", "cleared", "cleared_reason"])


@asset(group_name="planning", kinds={"sql"}, deps=["candidate_gears"],
       description="Health tags of gears: an unhealthy gear is not chosen until the profile is refreshed or the model changes.")
def gear_health(context: AssetExecutionContext, store: StoreResource) -> MaterializeResult:
    db = store.get_store()
    tags = db.health_tags(include_cleared=True)
    unhealthy = sorted(db.unhealthy_gear_keys())
    context.log.info(f"{len(unhealthy)} unhealthy gear(s): {', '.join(unhealthy) or 'none'}")
    return MaterializeResult(metadata={"unhealthy_gears": len(unhealthy), "unhealthy": ", ".join(unhealthy) or "none",
                                       "tags": table_metadata(health_table(tags[-50:]))})
