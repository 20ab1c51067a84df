"""The head's control store: a small authenticated key/value + queue server, and its client.

One per run, on one port, bound to exactly the interface asked for (``127.0.0.1`` for a run on one
host; ``--listen HOST:PORT`` binds ``HOST``; every interface only for ``0.0.0.0`` / ``::``). Every
connection proves the run secret first and every request is a MAC'd, sequenced frame
(:mod:`~flexpipe_dag.runtime.control_auth`). It replaces ``torch.distributed.TCPStore``, which
listens on every interface whatever host it is given and has no authentication.

Keys and who may touch them (the head uses the store in-process through :attr:`ControlStoreServer.local`,
with no restriction):

* ``pg/...``: the ``torch.distributed`` rendezvous (through :class:`ControlStoreClient`, a
  ``torch.distributed.Store``): any authenticated process may read and write;
* ``claim/<w>``: taken with :meth:`ControlStoreClient.claim` only (one worker per slot; the
  connection is then bound to slot ``w``, and its :meth:`~ControlStoreClient.clone` copies too);
* ``hb/<w>``, ``exit/<w>`` (values), ``events/<w>``, ``obs/<w>`` (queues): written only by a
  connection bound to slot ``w``; queues are popped only by the head;
* ``spec``, ``abort`` and anything else: read-only for clients (only the head publishes them).

Limits (:class:`StoreLimits`): bytes per value, key length (ASCII printable only), number of keys,
total bytes held (keys and values), queue length, authenticated connections, connections still in
their handshake (a separate, smaller cap: the oldest is closed for a new one, so unauthenticated
sockets never keep a worker out), and seconds for the whole handshake. A request over a quota or
malformed (a bad slot, token, key or integer) is refused with a reason (the client raises
:class:`ControlStoreError`), counted in :attr:`ControlStoreServer.refusals` and logged on one line,
once per reason; a connection that breaks the protocol (bad secret, oversize frame, bad MAC,
replay) is dropped, counted and logged the same way.
"""

from __future__ import annotations

import collections
import logging
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from flexpipe_dag.runtime.control_auth import (
    Channel,
    ChannelError,
    NotAdmitted,
    PeerClosed,
    SecretRefused,
    client_handshake,
    server_handshake,
)
from flexpipe_dag.runtime.listen_address import resolve_bind_host

log = logging.getLogger(__name__)

_SET, _GET, _ADD, _CHECK, _DELETE, _CSET, _NUM_KEYS, _QPUSH, _QPOP, _QLEN, _CLAIM, _BIND = range(1, 13)
_OK, _MISSING, _REFUSED = 0, 1, 2
_REQ = struct.Struct(">BH")
_I64 = struct.Struct(">q")
_WORKER_KEYS = ("hb", "exit")  # values a bound worker writes
_WORKER_QUEUES = ("events", "obs")  # queues a bound worker pushes to
_MAX_SLOT_DIGITS = 6
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INTEGER = re.compile(rb"-?[0-9]{1,19}")


class ControlStoreError(RuntimeError):
    """The control store refused a request (a quota, or a key this process may not write)."""


class ClaimRefused(ControlStoreError):
    """The worker slot is already claimed, or outside the pipeline."""


@dataclass(frozen=True)
class StoreLimits:
    """Quotas of a :class:`ControlStoreServer`.

    Attributes:
        max_value_bytes: largest value or queue item, bytes.
        max_key_bytes: longest key, bytes (ASCII printable characters only).
        max_keys: keys + queues held at once.
        max_total_bytes: bytes of keys, values and queue items held at once.
        max_queue_len: items per queue.
        max_connections: authenticated connections open at once; a client over it is closed before
            the handshake's answer (and retries within its connect timeout).
        max_pending_connections: connections still in their handshake; a new one over it closes the
            oldest (unauthenticated connections never count toward ``max_connections``).
        handshake_timeout_s: seconds a new connection has for the whole handshake (one deadline).
    """

    max_value_bytes: int = 1 << 20
    max_key_bytes: int = 256
    max_keys: int = 4096
    max_total_bytes: int = 64 << 20
    max_queue_len: int = 4096
    max_connections: int = 128
    max_pending_connections: int = 16
    handshake_timeout_s: float = 5.0


class _Conn:
    """Server-side state of one connection."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.worker: int | None = None  # the slot this connection may write for
        self.authenticated = False
        self.evicted = False  # closed to make room for a newer unauthenticated connection
        self.opened_s = time.monotonic()


class ControlStoreServer:
    """The store, its listening socket (bound to exactly ``host``) and one thread per connection.

    Args:
        host: the interface to bind (an IP or a host name; ``0.0.0.0`` / ``::`` for every one).
        port: TCP port; 0 lets the kernel pick one (see :attr:`port`; no free-port race).
        secret: the run secret every client must prove.
        num_workers: worker slots that may be claimed (``claim/0`` .. ``claim/<num_workers - 1>``).
        limits: quotas (:class:`StoreLimits`).

    Raises:
        OSError: the address cannot be bound (in use, not an address of this host).
    """

    def __init__(self, host: str, port: int, secret: str, num_workers: int = 0, limits: StoreLimits | None = None):
        self.limits = limits or StoreLimits()
        self._secret = secret
        self.num_workers = num_workers
        family, addr = resolve_bind_host(host)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and addr == "::":
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" means every interface, v4 too
            sock.bind((addr, port))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.bound_host: str = sock.getsockname()[0]
        self.port: int = sock.getsockname()[1]
        self._values: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = {}
        self._claims: dict[int, str] = {}  # slot -> token
        self._bytes = 0
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._closed = threading.Event()
        #: reason -> how many connections / requests were refused for it
        self.refusals: collections.Counter[str] = collections.Counter()
        self.local = _LocalView(self)
        self._thread = threading.Thread(target=self._accept_loop, name="flexpipe-control-store", daemon=True)
        self._thread.start()

    @property
    def connect_host(self) -> str:
        """An address a process on this host can connect to (loopback for a wildcard bind)."""
        return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bound_host, self.bound_host)

    @property
    def connections(self) -> int:
        """Connections open now (authenticated or still in their handshake)."""
        with self._lock:
            return len(self._conns)

    @property
    def authenticated_connections(self) -> int:
        """Connections open now that proved the secret."""
        with self._lock:
            return sum(c.authenticated for c in self._conns)

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _close_socket(c.sock)
        self._thread.join(timeout=2)

    # -- connections ------------------------------------------------------------------------------
    def _refuse(self, reason: str, peer: str, detail: str = "") -> None:
        with self._lock:
            self.refusals[reason] += 1
            first = self.refusals[reason] == 1
        if first:  # once per reason: an attacker cannot flood the log
            log.warning("control store: refused %s from %s%s (further ones counted, not logged)", reason, peer,
                        f": {detail}" if detail else "")

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            peer = f"{addr[0]}:{addr[1]}"
            conn = _Conn(sock, peer)
            with self._lock:  # a full handshake queue drops its oldest: an idle flood cannot keep a worker out
                pending = [c for c in self._conns if not c.authenticated and not c.evicted]
                oldest = (min(pending, key=lambda c: c.opened_s)
                          if len(pending) >= self.limits.max_pending_connections else None)
                if oldest is not None:
                    oldest.evicted = True
                self._conns.add(conn)
            if oldest is not None:
                _close_socket(oldest.sock)
                self._refuse("unauthenticated connection over the limit", oldest.peer,
                             f"{self.limits.max_pending_connections} in their handshake; the oldest closed")
            threading.Thread(target=self._serve, args=(conn,), name=f"flexpipe-control-{peer}", daemon=True).start()

    def _serve(self, conn: _Conn) -> None:
        chan: Channel | None = None
        try:
            chan = server_handshake(conn.sock, self._secret, self.limits.handshake_timeout_s,
                                    admit=lambda: self._admit(conn))
            conn.sock.settimeout(None)
            while not self._closed.is_set():
                body = chan.recv()
                chan.send(self._handle(conn, body))
        except SecretRefused as exc:
            self._refuse("wrong secret", conn.peer, str(exc))
        except TimeoutError:
            self._refuse("slow handshake", conn.peer, f"over {self.limits.handshake_timeout_s:.0f} s")
        except NotAdmitted:
            pass  # counted by _admit
        except ChannelError as exc:
            if not isinstance(exc, PeerClosed) and not conn.evicted:
                self._refuse("protocol violation", conn.peer, str(exc))
        except OSError:
            pass
        except Exception as exc:  # a bug must not print a traceback per request an attacker crafts
            self._refuse("internal error", conn.peer, f"{type(exc).__name__}: {exc}")
        finally:
            _close_socket(conn.sock)
            with self._lock:
                self._conns.discard(conn)

    def _admit(self, conn: _Conn) -> bool:
        """Mark ``conn`` authenticated unless it was evicted or the authenticated cap is reached."""
        with self._lock:
            if conn.evicted:
                return False
            if sum(c.authenticated for c in self._conns) >= self.limits.max_connections:
                full = True
            else:
                conn.authenticated, full = True, False
        if full:
            self._refuse("connection over the limit", conn.peer, f"{self.limits.max_connections} authenticated open")
        return not full

    def _handle(self, conn: _Conn, body: bytes) -> bytes:
        if len(body) < _REQ.size:
            raise ChannelError("request shorter than its header")
        op, klen = _REQ.unpack_from(body)
        raw_key = body[_REQ.size:_REQ.size + klen]
        value = body[_REQ.size + klen:]
        try:
            if klen > self.limits.max_key_bytes:
                raise ControlStoreError(f"key of {klen} bytes exceeds the {self.limits.max_key_bytes}-byte limit")
            if len(raw_key) != klen or not all(0x20 <= b < 0x7F for b in raw_key):
                raise ControlStoreError("a key must be ASCII printable characters")
            return self._apply(conn, op, raw_key.decode("ascii"), value)
        except ControlStoreError as exc:
            self._refuse(type(exc).__name__ if isinstance(exc, ClaimRefused) else "request", conn.peer, str(exc))
            return bytes([_REFUSED]) + str(exc).encode()
        except (ValueError, TypeError, OverflowError, struct.error) as exc:  # malformed: refused, never a traceback
            self._refuse("malformed request", conn.peer, f"{type(exc).__name__}: {exc}")
            return bytes([_REFUSED]) + b"malformed request"

    def _apply(self, conn: _Conn, op: int, key: str, value: bytes) -> bytes:  # one case per request kind
        if op in (_GET, _CHECK, _QLEN, _NUM_KEYS):  # reads: any authenticated process
            with self._lock:
                if op == _GET:
                    v = self._values.get(key)
                    return bytes([_MISSING]) if v is None else bytes([_OK]) + v
                if op == _CHECK:
                    return bytes([_OK, key in self._values])
                if op == _QLEN:
                    return bytes([_OK]) + _I64.pack(len(self._queues.get(key, ())))
                return bytes([_OK]) + _I64.pack(len(self._values) + len(self._queues))
        if op == _CLAIM:
            w = _slot(key, self.num_workers)
            token = self.claim(w)
            conn.worker = w
            return bytes([_OK]) + token.encode()
        if op == _BIND:
            w = _slot(key, self.num_workers)
            with self._lock:
                ok = secrets.compare_digest(self._claims.get(w, "").encode(), bytes(value))  # bytes: any input
            if not ok:
                raise ControlStoreError(f"no claim of worker slot {w} with that token")
            conn.worker = w
            return bytes([_OK])
        self._authorise(conn, op, key)
        if op == _SET:
            self.local.set(key, value)
            return bytes([_OK])
        if op == _ADD:
            if len(value) != _I64.size:
                raise ControlStoreError("add expects an 8-byte integer")
            return bytes([_OK]) + _I64.pack(self.local.add(key, _I64.unpack(value)[0]))
        if op == _CSET:
            (n,) = _I64.unpack_from(value) if len(value) >= _I64.size else (-1,)
            if not 0 <= n <= len(value) - _I64.size:
                raise ControlStoreError("compare_set expects a length-prefixed expected value")
            expected, desired = value[_I64.size:_I64.size + n], value[_I64.size + n:]
            return bytes([_OK]) + self.local.compare_set(key, expected, desired)
        if op == _DELETE:
            return bytes([_OK, self.local.delete_key(key)])
        if op == _QPUSH:
            self.local.queue_push(key, value)
            return bytes([_OK])
        raise ChannelError(f"unknown request kind {op}")

    def _authorise(self, conn: _Conn, op: int, key: str) -> None:
        if key.startswith("pg/") and op in (_SET, _ADD, _CSET, _DELETE):
            return
        kind, _, slot = key.partition("/")
        owned = conn.worker is not None and slot == str(conn.worker)
        if owned and ((op == _SET and kind in _WORKER_KEYS) or (op == _QPUSH and kind in _WORKER_QUEUES)):
            return
        who = f"worker slot {conn.worker}" if conn.worker is not None else "an unclaimed connection"
        raise ControlStoreError(f"{who} may not write {key!r}")

    # -- data (under the lock) --------------------------------------------------------------------
    def claim(self, worker: int) -> str:
        """Take worker slot ``worker`` (sets ``claim/<worker>``); returns the token that binds further
        connections of the same worker (:meth:`ControlStoreClient.clone`).

        Raises:
            ClaimRefused: the slot is claimed already.
        """
        with self._lock:
            if worker in self._claims:
                raise ClaimRefused(f"worker slot {worker} is already claimed")
            self._put(f"claim/{worker}", b"1")
            token = self._claims[worker] = secrets.token_hex(16)
            return token

    def _put(self, key: str, value: bytes) -> None:
        lim = self.limits
        if len(value) > lim.max_value_bytes:
            raise ControlStoreError(f"value of {len(value)} bytes for {key!r} exceeds the {lim.max_value_bytes}-byte limit")
        old = self._values.get(key)
        grow = len(value) - (len(old) if old is not None else -len(key.encode()))  # a new key's bytes count too
        if old is None and len(self._values) + len(self._queues) >= lim.max_keys:
            raise ControlStoreError(f"the store holds {lim.max_keys} keys (its limit)")
        if self._bytes + grow > lim.max_total_bytes:
            raise ControlStoreError(f"the store holds {self._bytes} bytes; {key!r} would pass its "
                                    f"{lim.max_total_bytes}-byte limit")
        self._values[key] = value
        self._bytes += grow


def _slot(key: str, num_workers: int) -> int:
    """Slot number ``key``: ASCII digits only (not "²" or "١"), at most :data:`_MAX_SLOT_DIGITS` of them."""
    if (not key or len(key) > _MAX_SLOT_DIGITS or not key.isascii() or not key.isdigit()
            or not 0 <= int(key) < num_workers):
        raise ClaimRefused(f"worker slot {key!r} is outside this pipeline (0..{num_workers - 1})")
    return int(key)


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _LocalView:
    """The head's in-process access to its store (the Store methods the head uses; no authorisation)."""

    def __init__(self, server: ControlStoreServer):
        self._s = server

    def set(self, key: str, value: str | bytes) -> None:
        s = self._s
        with s._lock:
            s._put(key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``; KeyError when it is not set (no waiting: the head never waits on itself)."""
        with self._s._lock:
            return self._s._values[key]

    def check(self, keys: Iterable[str]) -> bool:
        with self._s._lock:
            return all(k in self._s._values for k in keys)

    def add(self, key: str, amount: int) -> int:
        s = self._s
        with s._lock:
            old = s._values.get(key, b"0")
            if not _INTEGER.fullmatch(old):
                raise ControlStoreError(f"{key!r} does not hold a 64-bit integer")
            new = int(old) + amount
            if not _INT64_MIN <= new <= _INT64_MAX:  # checked before anything is stored
                raise ControlStoreError(f"adding {amount} to {key!r} passes the 64-bit integer range")
            s._put(key, str(new).encode())
            return new

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        s = self._s
        with s._lock:
            cur = s._values.get(key)
            if (cur is None and not expected) or cur == expected:
                s._put(key, desired)
                return desired
            return cur if cur is not None else expected

    def delete_key(self, key: str) -> bool:
        s = self._s
        with s._lock:
            old = s._values.pop(key, None)
            if old is not None:
                s._bytes -= len(old) + len(key.encode())
            return old is not None

    def queue_push(self, key: str, value: bytes) -> None:
        s = self._s
        lim = s.limits
        with s._lock:
            q = s._queues.get(key)
            if len(value) > lim.max_value_bytes:
                raise ControlStoreError(f"item of {len(value)} bytes for queue {key!r} exceeds the "
                                        f"{lim.max_value_bytes}-byte limit")
            if q is None and len(s._values) + len(s._queues) >= lim.max_keys:
                raise ControlStoreError(f"the store holds {lim.max_keys} keys (its limit)")
            if q is not None and len(q) >= lim.max_queue_len:
                raise ControlStoreError(f"queue {key!r} holds {lim.max_queue_len} items (its limit)")
            grow = len(value) + (len(key.encode()) if q is None else 0)  # a new queue's key counts too
            if s._bytes + grow > lim.max_total_bytes:
                raise ControlStoreError(f"the store holds {s._bytes} bytes; queue {key!r} would pass its "
                                        f"{lim.max_total_bytes}-byte limit")
            s._queues.setdefault(key, collections.deque()).append(bytes(value))
            s._bytes += grow

    def queue_len(self, key: str) -> int:
        with self._s._lock:
            return len(self._s._queues.get(key, ()))

    def queue_pop(self, key: str, block: bool = False) -> bytes:
        """The oldest item of queue ``key``; KeyError when it is empty (never blocks)."""
        s = self._s
        with s._lock:
            q = s._queues.get(key)
            if not q:
                raise KeyError(key)
            v = q.popleft()
            s._bytes -= len(v)
            return v

    def claimed(self, worker: int) -> bool:
        with self._s._lock:
            return worker in self._s._claims


class ControlStoreClient(dist.Store):
    """A client of a :class:`ControlStoreServer`: a ``torch.distributed.Store`` (for
    ``init_process_group(store=...)``; gloo and NCCL rendezvous through it) plus the queue calls
    and :meth:`claim`.

    Args:
        host, port: the head's control store.
        secret: the run secret.
        timeout_s: how long to keep trying to connect, and the default wait of :meth:`get` / :meth:`wait`.

    Raises:
        SecretRefused: the head refused the secret, or could not prove it holds it.
        ConnectionError: no store answered within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, secret: str, timeout_s: float = 300.0, _token: tuple[int, str] | None = None):
        super().__init__()
        self._addr, self._secret = (host, port), secret
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._token = _token
        self._chan = self._connect(timeout_s)
        if _token is not None:
            self._call(_BIND, str(_token[0]), _token[1].encode())

    def _connect(self, timeout_s: float) -> Channel:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection(self._addr, timeout=max(0.1, min(left, 10.0)))
            except OSError as exc:  # not listening yet: retry until the deadline
                if left <= 0:
                    raise ConnectionError(f"no control store at {self._addr[0]}:{self._addr[1]}: {exc}") from None
                time.sleep(min(0.2, max(0.0, left)))
                continue
            try:
                chan = client_handshake(sock, self._secret)
            except (PeerClosed, ConnectionResetError, BrokenPipeError, TimeoutError) as exc:
                _close_socket(sock)  # closed or reset mid-handshake (a full or busy store): retry
                if time.monotonic() >= deadline:
                    why = ("accepted but never finished the handshake: a busy FlexPipe head, or not a FlexPipe head"
                           if isinstance(exc, TimeoutError) else "closed every connection during the handshake")
                    raise ConnectionError(f"{self._addr[0]}:{self._addr[1]} {why} for {timeout_s:.0f} s "
                                          f"({type(exc).__name__})") from None
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                continue
            except BaseException:
                _close_socket(sock)
                raise
            sock.settimeout(60.0)  # a head that stops answering mid-request is a lost head
            return chan

    def _call(self, op: int, key: str, value: bytes = b"") -> tuple[int, bytes]:
        k = key.encode()
        with self._lock:
            self._chan.send(_REQ.pack(op, len(k)) + k + value)
            reply = self._chan.recv()
        if not reply:
            raise ChannelError("empty reply")
        if reply[0] == _REFUSED:
            text = reply[1:].decode(errors="replace")
            raise (ClaimRefused if op == _CLAIM else ControlStoreError)(text)
        return reply[0], reply[1:]

    # -- torch.distributed.Store ------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._call(_SET, key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the timeout for it to be set.

        Raises:
            torch.distributed.DistStoreError: not set within the timeout.
        """
        deadline, pause = time.monotonic() + self._timeout_s, 0.005
        while True:
            status, v = self._call(_GET, key)
            if status == _OK:
                return v
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"timed out after {self._timeout_s:.0f} s waiting for {key!r}")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def add(self, key: str, value: int) -> int:
        return _I64.unpack(self._call(_ADD, key, _I64.pack(int(value)))[1])[0]

    def check(self, keys) -> bool:
        return all(self._call(_CHECK, k)[1] == b"\x01" for k in keys)

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout is not None else self._timeout_s
        deadline, pause = time.monotonic() + limit, 0.005
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"timed out after {limit:.0f} s waiting for {list(keys)}")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def compare_set(self, key: str, expected, desired) -> bytes:
        e = expected.encode() if isinstance(expected, str) else bytes(expected)
        d = desired.encode() if isinstance(desired, str) else bytes(desired)
        return self._call(_CSET, key, _I64.pack(len(e)) + e + d)[1]

    def delete_key(self, key: str) -> bool:
        return self._call(_DELETE, key)[1] == b"\x01"

    def num_keys(self) -> int:
        return _I64.unpack(self._call(_NUM_KEYS, "")[1])[0]

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    # -- queues and claims ------------------------------------------------------------------------
    def queue_push(self, key: str, value) -> None:
        self._call(_QPUSH, key, value.encode() if isinstance(value, str) else bytes(value))

    def queue_len(self, key: str) -> int:
        return _I64.unpack(self._call(_QLEN, key)[1])[0]

    def claim(self, worker: int) -> None:
        """Take worker slot ``worker`` for this connection (and its clones).

        Raises:
            ClaimRefused: claimed already, or outside the pipeline.
        """
        self._token = (worker, self._call(_CLAIM, str(worker))[1].decode())

    def clone(self) -> ControlStoreClient:
        """A second connection to the same store, bound to the same claim (for another thread)."""
        return ControlStoreClient(*self._addr, self._secret, self._timeout_s, _token=self._token)

    def close(self) -> None:
        self._chan.close()
