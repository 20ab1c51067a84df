"""Which address a listening socket binds: the checks both ``--listen`` parsing and the control
store's bind use (stdlib only). Every interface only when spelled ``0.0.0.0`` or ``::``; numeric
shorthands ``inet_aton`` accepts (``0``, ``127.1``, ``0x7f000001``) are refused."""

from __future__ import annotations

import ipaddress
import socket


def _every_interface(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """``ip`` listens on every interface: the unspecified address, or IPv6's IPv4-mapped form of it
    (``::ffff:0.0.0.0`` binds every IPv4 interface on a dual-stack socket)."""
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def listen_host_problem(host: str) -> str | None:
    """Why ``host`` is refused as an address to listen on, or ``None``: the numeric shorthands
    ``inet_aton`` accepts but nobody means to write (``0`` is every interface, ``127.1``,
    ``0x7f000001``, ``2130706433``) are refused; a dotted address, an IPv6 address or a name is fine."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if _every_interface(ip) and host not in ("0.0.0.0", "::"):
            return f"{host!r} means every interface; write 0.0.0.0 (or ::) to listen on all of them"
        return None
    try:
        socket.inet_aton(host)
    except OSError:
        return None  # a host name
    return (f"{host!r} is a numeric shorthand for an IPv4 address (it reads as {socket.inet_ntoa(socket.inet_aton(host))}); "
            f"write a dotted address (e.g. 127.0.0.1, or 0.0.0.0 for every interface) or a host name")


def resolve_bind_host(host: str) -> tuple[socket.AddressFamily, str]:
    """``(family, address)`` to bind for ``host``: an IP as given, a host name resolved to its
    first address (IPv4 preferred), ``""`` -> loopback. Every interface only when spelled
    ``0.0.0.0`` or ``::``.

    Raises:
        OSError: the name does not resolve; a numeric shorthand (``0``, ``127.1``, ``0x7f000001``:
            :func:`listen_host_problem`); another spelling or a name that means every interface.
    """
    if host in ("", "localhost"):
        return socket.AF_INET, "127.0.0.1"
    problem = listen_host_problem(host)
    if problem:
        raise OSError(problem)
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    family, *_rest, sockaddr = infos[0]
    address = str(sockaddr[0])
    if _every_interface(ipaddress.ip_address(address.split("%")[0])) and host not in ("0.0.0.0", "::"):
        raise OSError(f"{host!r} means every interface; write 0.0.0.0 (or ::) to listen on all of them, "
                      f"or the address of one interface")
    return family, address
