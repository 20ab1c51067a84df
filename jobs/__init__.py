"""Dagster jobs, schedules and sensors."""
