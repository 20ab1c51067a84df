"""Reaching the head's control store: ``HOST:PORT`` parsing and an authenticated store client.

Both the head (:mod:`~flexpipe_dag.runtime.remote`) and every rank's process-group set-up
(:func:`~flexpipe_dag.runtime.worker.setup_process`) use these, so they live apart from both.
"""

from __future__ import annotations

import os
import socket

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime.listen_address import listen_host_problem


def parse_address(text: str, field: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``.

    Raises:
        InputError: naming ``field`` when the text is not ``HOST:PORT`` with a port in 0..65535.
    """
    host, sep, port = str(text).rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if (not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535
            or (":" in host and not bracketed)):
        raise InputError(None, field, f"expected HOST:PORT (e.g. gpu-a100-0:29501, [::1]:29501 for IPv6), got {text!r}")
    return host.strip("[]"), int(port)


def parse_listen_address(text: str, field: str) -> tuple[str, int]:
    """:func:`parse_address` for an address to listen on, refusing what :func:`listen_host_problem` does.

    Raises:
        InputError: naming ``field``: not ``HOST:PORT``, or an ambiguous numeric host.
    """
    host, port = parse_address(text, field)
    problem = listen_host_problem(host)
    if problem:
        raise InputError(None, field, problem)
    return host, port


def connect(host: str, port: int, timeout_s: float, secret: str):
    """An authenticated client (:class:`~flexpipe_dag.runtime.control_store.ControlStoreClient`, a
    ``torch.distributed.Store``) of the head's control store; retries until the head is up or
    ``timeout_s`` seconds pass.

    Raises:
        SecretRefused: the head refused ``secret`` (or could not prove it holds it).
        ConnectionError: nothing listened within ``timeout_s``.
    """
    from flexpipe_dag.runtime.control_store import ControlStoreClient

    return ControlStoreClient(host, port, secret, timeout_s)


#: Clients behind the process-group stores this process made: torch's C++ PrefixStore holds only the
#: C++ half of a Python ``Store`` subclass, whose Python methods vanish once the object is collected.
_PG_CLIENTS: list = []


def process_group_store(host: str, port: int, timeout_s: float, secret: str):
    """The ``torch.distributed`` store for ``init_process_group(store=...)``: the head's control store
    under the ``pg/`` prefix, kept alive for this process's lifetime.

    Raises:
        As :func:`connect`.
    """
    import torch.distributed as dist

    client = connect(host, port, timeout_s, secret)
    _PG_CLIENTS.append(client)
    return dist.PrefixStore("pg", client)


def keep_backend_on_loopback() -> None:
    """Keep this process's gloo / NCCL data connections on the loopback interface (both otherwise
    listen on the interface of this host's name): for ranks that all run on this host. A value the
    user already set in ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` is kept."""
    lo = next((name for _i, name in socket.if_nameindex() if name.startswith("lo")), None)
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
