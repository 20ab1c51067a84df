"""The front door: an OpenAI-compatible HTTP API (completions, chat, streaming), health, readiness and
Prometheus metrics over a live pipeline (``flexpipe serve``)."""
