"""Reaching the head's control store: ``HOST:PORT`` parsing and a store client.

Both the head (:mod:`~flexpipe_dag.runtime.remote`) and every rank's process-group set-up
(:func:`~flexpipe_dag.runtime.worker.setup_process`) use these, so they live apart from both.
"""

from __future__ import annotations

from datetime import timedelta

from flexpipe_dag.core.errors import InputError


def parse_address(text: str, field: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``.

    Raises:
        InputError: naming ``field`` when the text is not ``HOST:PORT`` with a port in 0..65535.
    """
    host, sep, port = str(text).rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if (not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535
            or (":" in host and not bracketed)):
        raise InputError(None, field, f"expected HOST:PORT (e.g. gpu-a100-0:29501, [::1]:29501 for IPv6), got {text!r}")
    return host.strip("[]"), int(port)


def connect(host: str, port: int, timeout_s: float):
    """A ``torch.distributed.TCPStore`` client of the head's control store (retries until the head
    is up or ``timeout_s`` seconds pass)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
