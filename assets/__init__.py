"""Dagster assets: what FlexPipe knows, kept in the SQL store (assets return MaterializeResults)."""
