"""Serving a live pipeline: replaying a real trace through the runtime, shifting gears, reporting."""
