"""Attacks on the control plane (issue #15, scope 1), all on this host: the head's control store
refuses unauthenticated clients, tampered and replayed frames, oversize messages and connection
floods with bounded memory, keeps a worker to its own slot, binds exactly the interface named,
and a live run attacked meanwhile still produces transformers' tokens."""

from __future__ import annotations

import os
import queue
import socket
import stat
import struct
import threading
import time
from datetime import timedelta

import pytest

pytest.importorskip("torch")

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime.control_auth import (
    HeadSecret,
    SecretRefused,
    client_handshake,
    read_secret_file,
    write_secret_file,
)
from flexpipe_dag.runtime.control_store import ControlStoreError, ControlStoreServer, StoreLimits
from flexpipe_dag.runtime.messages import ProcessFailed, StageReady, to_json
from flexpipe_dag.runtime.remote import ControlServer, connect, serve_stage
from flexpipe_dag.runtime.worker import WorkerSpec
from tests.support import wait_until
from tests.test_runtime_helpers import checkpoint, gear, hf_reference, requests

SECRET = "s3cret-" + "fedcba9876543210" * 3
WRONG = "wrong-" + "0123456789abcdef" * 3
MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _raw_session(port: int, secret: str = SECRET):
    """A correct handshake on a raw socket: ``(socket, channel)`` for hand-made frames."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock, client_handshake(sock, secret)


def _dropped(sock: socket.socket) -> bool:
    """The server closed the connection (EOF or reset) within 5 s."""
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def _non_loopback_ip() -> str | None:
    """An address of this host that is not loopback (what another machine would connect to)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing interface
        ip = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if ip.startswith("127.") else ip


@pytest.fixture
def head():
    server = ControlServer(0, 2, secret=SECRET)
    server.publish(WorkerSpec(str(checkpoint().path), "smol", [(0, 15), (15, 30)], 8, 16,
                              control_secret=SECRET))
    yield server
    server.close()


# -- authentication --------------------------------------------------------------------------------
def test_a_client_without_the_secret_reads_and_writes_nothing(head):
    for secret in (WRONG, ""):
        with pytest.raises(SecretRefused):
            connect("127.0.0.1", head.port, 5, secret or "x" * 32)
    import torch.distributed as dist

    with pytest.raises(RuntimeError):  # torch's DistError; the old attack tool: a TCPStore client gets nothing, not even the spec
        dist.TCPStore("127.0.0.1", head.port, is_master=False, timeout=timedelta(seconds=3)).get("spec")
    raw = socket.create_connection(("127.0.0.1", head.port), timeout=5)  # plain bytes, no handshake
    raw.recv(36)
    raw.sendall(b"GET spec\n" + b"\0" * 59)
    assert _dropped(raw)
    raw = socket.create_connection(("127.0.0.1", head.port), timeout=5)  # the protocol, a guessed proof
    raw.recv(36)
    raw.sendall(b"FPC1" + os.urandom(64))
    assert raw.recv(16) == b"DENY" and _dropped(raw)
    main = head.server.local
    assert head.claimed() == [] and not main.check(["abort"]) and main.queue_len("events/0") == 0
    assert not main.check(["hb/0"]) and not main.check(["exit/0"])
    assert head.server.refusals["wrong secret"] >= 3


def test_spec_is_published_without_the_secret(head):
    store = connect("127.0.0.1", head.port, 5, SECRET)
    assert SECRET.encode() not in store.get("spec")


def test_a_worker_writes_only_its_own_slot_and_never_spec_or_abort(head):
    unclaimed = connect("127.0.0.1", head.port, 5, SECRET)
    for write in (lambda s: s.set("abort", "stop"), lambda s: s.set("spec", "{}"), lambda s: s.set("hb/0", b"x"),
                  lambda s: s.set("exit/0", "0"), lambda s: s.queue_push("events/0", to_json(ProcessFailed(0, "x", False))),
                  lambda s: s.set("claim/0", "1"), lambda s: s.add("claim/1", 1)):
        with pytest.raises(ControlStoreError, match="may not write"):
            write(unclaimed)
    w0 = connect("127.0.0.1", head.port, 5, SECRET)
    w0.claim(0)
    w0.set("hb/0", b"\0" * 48)
    beat = w0.clone()  # a second connection of the same worker (its heartbeat thread) keeps the claim
    beat.set("exit/0", "0")
    for write in (lambda s: s.set("hb/1", b"x"), lambda s: s.queue_push("events/1", b"{}"),
                  lambda s: s.set("abort", "stop"), lambda s: s.set("exit/1", "1")):
        with pytest.raises(ControlStoreError, match="worker slot 0 may not write"):
            write(beat)
    with pytest.raises(ControlStoreError, match="already claimed"):
        unclaimed.claim(0)
    with pytest.raises(ControlStoreError, match="outside this pipeline"):
        unclaimed.claim(7)
    main = head.server.local
    assert head.claimed() == [0] and not main.check(["abort"]) and not main.check(["hb/1"])


def test_forged_events_and_malformed_reports_are_dropped_and_the_pump_goes_on(head):
    w0 = connect("127.0.0.1", head.port, 5, SECRET)
    w0.claim(0)
    info = {"stage_index": 1, "replica_index": 0, "layer_start": 15, "layer_end": 30, "param_bytes": 1,
            "kv_pool_bytes": 1, "kv_capacity_tokens": 1, "pid": 1, "host": "h", "observations_path": None}
    from flexpipe_dag.runtime.messages import StageInfo

    w0.queue_push("events/0", to_json(StageReady(1, StageInfo(**info))))  # slot 0 posing as slot 1
    w0.queue_push("events/0", to_json(ProcessFailed(1, "stage failed", False)))
    w0.queue_push("events/0", b"\x80not json")
    w0.set("hb/0", b"short")
    w0.queue_push("obs/0", b"\0" * 13)
    w0.set("exit/0", "not a number")
    events: queue.Queue = queue.Queue()
    counters = [0.0] * 12
    head.start(events, counters)
    try:
        wait_until(lambda: len(head.ignored) == 4, 5, "the pump to look at every report")
        w0.set("hb/0", struct.pack("<qd4d", 1, time.monotonic(), 3.0, 0.5, 0.0, 0.0))
        wait_until(lambda: counters[4] == 3.0, 5, "a good heartbeat after the bad ones")
    finally:
        head.close()
    assert events.empty()  # no forged StageReady / failure reached the runtime, no "control store failed"
    assert head.workers[0].exitcode is None and head.workers[1].pid is None
    assert set(head.ignored) == {(0, "event"), (0, "heartbeat"), (0, "observation item"), (0, "exit status")}


# -- tampering and replays -------------------------------------------------------------------------
def test_tampered_and_replayed_frames_drop_the_connection_and_nothing_else(head):
    good = connect("127.0.0.1", head.port, 5, SECRET)
    sock, chan = _raw_session(head.port)
    body = struct.pack(">BH", 1, 6) + b"pg/key" + b"value"  # SET pg/key
    captured: list[bytes] = []

    class Recorder:  # the channel's socket, recording what it sends
        def sendall(self, data: bytes) -> None:
            captured.append(bytes(data))
            sock.sendall(data)

        def recv_into(self, buf) -> int:
            return sock.recv_into(buf)

    chan.sock = Recorder()  # type: ignore[assignment]
    chan.send(body)
    assert chan.recv()[:1] == b"\0"
    sock.sendall(captured[0])  # the same frame again: a replay
    assert _dropped(sock)
    sock, chan = _raw_session(head.port)
    frame = bytearray(struct.pack(">I", 8 + len(body) + 32) + struct.pack(">Q", 0) + body + b"\0" * 32)
    sock.sendall(bytes(frame))  # a frame whose MAC does not match (tampered body or forged MAC)
    assert _dropped(sock)
    assert head.server.refusals["protocol violation"] == 2
    assert good.get("pg/key") == b"value" and good.check(["pg/key"])  # the honest client is unaffected


# -- size and connection limits, bounded memory ---------------------------------------------------
def test_oversize_messages_are_refused_before_allocating_and_memory_stays_bounded():
    server = ControlStoreServer("127.0.0.1", 0, SECRET, 1)
    junk = b"\xab" * (8 * MIB)
    try:
        ok = connect("127.0.0.1", server.port, 5, SECRET)
        ok.set("pg/warm", b"x")  # warm the code paths before measuring
        rss0 = _rss_bytes()
        t0 = time.monotonic()
        for _ in range(25):  # unauthenticated: 8 MiB of junk instead of a handshake
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            try:
                s.sendall(junk)
            except OSError:
                pass
            s.close()
        for _ in range(25):  # authenticated: a frame header announcing 8 MiB, then the 8 MiB
            s, _chan = _raw_session(server.port)
            try:
                s.sendall(struct.pack(">I", 8 * MIB) + junk)
            except OSError:
                pass
            assert _dropped(s)
        for i in range(25):  # authenticated, through the client: an 8 MiB value
            with pytest.raises(Exception, match="frame limit|exceeds"):
                ok.set(f"pg/big{i}", junk)
        grown = _rss_bytes() - rss0
        elapsed = time.monotonic() - t0
        print(f"75 x 8 MiB attempts: head RSS {rss0 / MIB:.1f} MiB -> +{grown / MIB:.1f} MiB in {elapsed:.1f} s")
        assert grown < 40 * MIB, f"head memory grew by {grown / MIB:.0f} MiB"
        assert ok.get("pg/warm") == b"x" and not ok.check(["pg/big0"])
        assert server.refusals["wrong secret"] + server.refusals["protocol violation"] >= 25
    finally:
        server.close()


def test_quotas_bound_what_an_authenticated_client_can_store():
    server = ControlStoreServer("127.0.0.1", 0, SECRET, 1, StoreLimits(max_value_bytes=1024, max_keys=8,
                                                                        max_total_bytes=3500, max_queue_len=3))
    try:
        c = connect("127.0.0.1", server.port, 5, SECRET)
        with pytest.raises(ControlStoreError, match="1024-byte limit"):
            c.set("pg/a", b"x" * 1025)
        for i in range(3):
            c.set(f"pg/{i}", b"x" * 1024)
        with pytest.raises(ControlStoreError, match="3500-byte limit"):
            c.set("pg/3", b"x" * 1024)
        c.claim(0)
        for _ in range(3):
            c.queue_push("obs/0", b"r")
        with pytest.raises(ControlStoreError, match="3 items"):
            c.queue_push("obs/0", b"r")
        for i in range(3):
            c.set(f"pg/k{i}", b"")
        with pytest.raises(ControlStoreError, match="8 keys"):
            c.set("pg/one-too-many", b"")
        assert c.get("pg/0") == b"x" * 1024  # the connection survives refusals
    finally:
        server.close()


def test_connection_flood_is_capped_and_idle_handshakes_time_out():
    limits = StoreLimits(max_pending_connections=8, handshake_timeout_s=0.5)
    server = ControlStoreServer("127.0.0.1", 0, SECRET, 1, limits)
    flood = []
    try:
        for _ in range(40):
            flood.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        wait_until(lambda: server.refusals["unauthenticated connection over the limit"] >= 30
                   and server.connections <= 8, 5, "the oldest unauthenticated connections to be closed")
        wait_until(lambda: server.connections == 0, 5, "idle half-open connections to be dropped")
        assert server.refusals["slow handshake"] >= 1
        ok = connect("127.0.0.1", server.port, 5, SECRET)  # once the flood is gone, a worker gets in
        ok.set("pg/x", b"1")
    finally:
        for s in flood:
            s.close()
        server.close()


def test_a_dribbling_handshake_flood_cannot_keep_a_worker_out():
    """Issue #15 review, 1: sockets that send one byte now and then are dropped when the whole
    handshake's deadline passes (not per read); a flood of them, however many, takes only the
    unauthenticated slots (oldest closed first), so workers still get in; a store full of
    authenticated connections makes a client retry within its connect timeout instead of failing."""
    limits = StoreLimits(max_connections=3, max_pending_connections=4, handshake_timeout_s=1.0)
    server = ControlStoreServer("127.0.0.1", 0, SECRET, 1, limits)
    flood: list[socket.socket] = []
    clients = []
    try:
        dribbler = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        dribbler.recv(36)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            for _ in range(20):  # one byte every 0.3 s: each read is in time, the handshake is not
                dribbler.sendall(b"F")
                time.sleep(0.3)
                if _dropped_now(dribbler):
                    raise OSError("dropped")
        assert time.monotonic() - t0 < 2.5 and server.refusals["slow handshake"] >= 1
        for _ in range(40):  # idle sockets, left open: more than the unauthenticated cap
            flood.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        wait_until(lambda: server.refusals["unauthenticated connection over the limit"] >= 36
                   and server.connections <= 4, 5, "the oldest unauthenticated connections to be closed")
        t0 = time.monotonic()
        for _ in range(3):  # the workers get in while the flood is still open
            clients.append(connect("127.0.0.1", server.port, 5, SECRET))
        assert time.monotonic() - t0 < 3 and server.authenticated_connections == 3
        with pytest.raises(ConnectionError, match="closed every connection"):
            connect("127.0.0.1", server.port, 1, SECRET)  # full of authenticated ones: retried, then named
        assert server.refusals["connection over the limit"] >= 1
        threading.Timer(0.5, clients.pop().close).start()
        late = connect("127.0.0.1", server.port, 5, SECRET)  # retries until a place frees up
        late.set("pg/late", b"1")
        clients.append(late)
    finally:
        for s in flood:
            s.close()
        for c in clients:
            c.close()
        server.close()


def _dropped_now(sock: socket.socket) -> bool:
    """The server has closed ``sock`` (checked without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def test_transport_header_claims_are_bounded_before_allocating():
    import torch

    from flexpipe_dag.runtime import transport as tp

    for header in ([1, 1 << 40, -1, 0, 0, 0, 0, 0, 1], [1, 10, 2, 0, 1 << 20, 1 << 20, 0, 0, 0],
                   [1, 10, 1, 0, -5, 0, 0, 0, 1], [1, 10, 1, -1, 5, 0, 0, 0, 1], [1, 10, -1, 0, 0, 0, 0, 0, 7]):
        with pytest.raises(tp.TransportError, match="malformed header|limit"):
            tp.check_header(1, header + [0, 0, 0])
    head = torch.zeros(tp.HEAD_BYTES, dtype=torch.uint8)  # an inline body claimed larger than the head
    head[:96] = torch.tensor([1, tp.HEAD_BYTES, -1, 0, 0, 0, 0, 0, 1, 0, 0, 0], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(tp.TransportError, match="does not fit"):
        tp._unframe(1, head, "cpu")


# -- binding ---------------------------------------------------------------------------------------
def test_listen_on_loopback_is_not_reachable_on_another_interface():
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions

    rt = PipelineRuntime(gear([(0, 15), (15, 30)]), checkpoint(), RuntimeOptions(control_address="127.0.0.1:0"))
    address = rt.listen()
    port = int(address.rsplit(":", 1)[1])
    try:
        assert rt._control is not None and rt._control.server._sock.getsockname() == ("127.0.0.1", port)
        ip = _non_loopback_ip()
        if ip is not None:
            with pytest.raises(OSError):
                socket.create_connection((ip, port), timeout=2).close()
    finally:
        rt.shutdown()
    every = ControlStoreServer("0.0.0.0", 0, SECRET)  # every interface: only when asked for
    try:
        assert every._sock.getsockname()[0] == "0.0.0.0"
    finally:
        every.close()


def test_local_runs_bind_loopback_only():
    """A one-host pipeline's rendezvous store, and its ranks' gloo connections, listen on 127.0.0.1
    only (the store on a port the kernel picked), and the run matches transformers."""
    import psutil

    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions

    ref = hf_reference()
    reqs = requests(2, prefix="loop-")
    rt = PipelineRuntime(gear([(0, 15), (15, 30)], micro_batch_size=2), checkpoint(), RuntimeOptions())
    with rt:
        listening = [c.laddr for p in [psutil.Process(), *psutil.Process().children(recursive=True)]
                     for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        outs = rt.generate(reqs)
    assert rt._local_store is None  # closed with the run
    assert len(listening) >= 4 and all(a.ip == "127.0.0.1" for a in listening), listening  # store + 3 ranks
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id.split("-")[-1]]
                                                                 for r in reqs}


# -- the secret ------------------------------------------------------------------------------------
def _published(secret_file):
    """``(secret, file)`` of a head that resolved ``secret_file`` and published it (as ``run --listen`` does)."""
    head = HeadSecret.resolve(secret_file)
    return head.secret, head.publish()


def test_secret_files_are_private_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEXPIPE_RUN_SECRET", raising=False)
    monkeypatch.delenv("FLEXPIPE_RUN_SECRET_FILE", raising=False)
    secret, path = _published(tmp_path / "run.secret")
    assert path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret_file(path) == secret and _published(path) == (secret, path)  # reused when it exists
    secret2, tmp = _published(None)
    assert tmp is not None and secret2 != secret and stat.S_IMODE(os.stat(tmp).st_mode) == 0o600
    tmp.unlink()
    short = tmp_path / "short.secret"
    short.write_text("abc\n")
    with pytest.raises(InputError, match=r"short.secret: --secret-file: expected a run secret of at least 32"):
        read_secret_file(short)
    with pytest.raises(InputError, match="--secret-file: cannot create"):
        write_secret_file(secret, path)  # never overwritten


def test_worker_without_or_with_a_wrong_secret_gets_one_line_naming_the_flag(head, monkeypatch, capsys):
    from flexpipe_dag.cli import main

    monkeypatch.delenv("FLEXPIPE_RUN_SECRET", raising=False)
    monkeypatch.delenv("FLEXPIPE_RUN_SECRET_FILE", raising=False)
    address = f"127.0.0.1:{head.port}"
    with pytest.raises(InputError, match=r"--secret-file \(or FLEXPIPE_RUN_SECRET_FILE\): the head at .* refused"):
        serve_stage(address, 0, connect_timeout_s=5, secret=WRONG)
    assert main(["worker", "--head", address, "--stage", "0", "--connect-timeout-s", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--secret-file" in err[0] and "expected the run's secret" in err[0]
    assert head.claimed() == []


# -- a live run under attack -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_live_run_under_attack_produces_its_results(tmp_path):
    """Workers started by hand with --secret-file; meanwhile an attacker without the secret tries to
    read the spec, claim a stage, post a failure and abort, and replays / tampers a real frame; an
    authenticated but unclaimed client tries to abort. The run finishes with transformers' tokens."""
    import subprocess
    import sys

    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from tests.test_runtime_remote import _env, _reap

    ref = hf_reference()
    reqs = requests(6, prefix="attack-")
    secret_file = tmp_path / "run.secret"
    secret, _ = _published(secret_file)
    rt = PipelineRuntime(gear([(0, 15), (15, 30)], micro_batch_size=2), checkpoint(),
                         RuntimeOptions(control_address="127.0.0.1:0", start_timeout_s=240, secret=secret))
    address = rt.listen()
    port = int(address.rsplit(":", 1)[1])
    procs = [subprocess.Popen([sys.executable, "-m", "flexpipe_dag.cli", "worker", "--head", address, "--stage", str(s),
                               "--secret-file", str(secret_file)], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True) for s in range(2)]
    stop = threading.Event()
    outcomes: dict[str, int] = {}

    def attack() -> None:
        while not stop.is_set():
            try:
                connect("127.0.0.1", port, 2, WRONG)
            except SecretRefused:
                outcomes["refused"] = outcomes.get("refused", 0) + 1
            except ConnectionError:  # the run has ended and its control store closed, before stop was set
                pass
            try:
                sock, chan = _raw_session(port, secret)  # an insider without a claim: replay + abort
                chan.send(struct.pack(">BH", 1, 5) + b"abort" + b"stop")
                outcomes["abort refused"] = outcomes.get("abort refused", 0) + (chan.recv()[:1] == b"\x02")
                sock.sendall(struct.pack(">I", 8 + 40) + struct.pack(">Q", 0) + b"\0" * 40)
                _dropped(sock)
                sock.close()
            except OSError:
                pass
            stop.wait(0.2)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        with rt:
            outs = rt.generate(reqs)
            server = rt._control.server if rt._control is not None else None
            refusals = dict(server.refusals) if server is not None else {}
    finally:
        stop.set()
        attacker.join(timeout=10)
        rt.shutdown()
        codes = _reap(procs)
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id.split("-")[-1]]
                                                                 for r in reqs}
    assert codes == [0, 0]
    assert outcomes.get("refused", 0) >= 1 and outcomes.get("abort refused", 0) >= 1, outcomes
    assert refusals.get("wrong secret", 0) >= 1 and refusals.get("protocol violation", 0) >= 1, refusals


def test_run_flags_for_the_secret_are_checked(monkeypatch, capsys):
    from flexpipe_dag.cli import main

    monkeypatch.delenv("FLEXPIPE_RUN_SECRET", raising=False)
    monkeypatch.delenv("FLEXPIPE_RUN_SECRET_FILE", raising=False)
    assert main(["run", "--stages", "2", "--trace", "azure-conv", "--secret-file", "run.secret"]) == 2
    assert "--secret-file: only with --listen or --launched" in capsys.readouterr().err
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    assert main(["run", "--launched", "--stages", "2", "--trace", "azure-conv"]) == 2  # a stage rank without it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--secret-file: --launched needs the run secret on every rank" in err[0]
    monkeypatch.setenv("FLEXPIPE_RUN_SECRET", "short")
    assert main(["run", "--launched", "--stages", "2", "--trace", "azure-conv"]) == 2
    assert "FLEXPIPE_RUN_SECRET: expected a run secret of at least 32" in capsys.readouterr().err


# -- crafted requests of an authenticated peer (issue #15 review, 6 and 7) ---------------------------
def _request(chan, op: int, key: bytes, value: bytes = b"") -> bytes:
    chan.send(struct.pack(">BH", op, len(key)) + key + value)
    return chan.recv()


def test_keys_are_capped_and_counted_in_the_byte_quota():
    server = ControlStoreServer("127.0.0.1", 0, SECRET, 1, StoreLimits(max_total_bytes=900))
    try:
        c = connect("127.0.0.1", server.port, 5, SECRET)
        with pytest.raises(ControlStoreError, match="key of 257 bytes exceeds the 256-byte limit"):
            c.set("pg/" + "k" * 254, b"")
        with pytest.raises(ControlStoreError, match="ASCII printable"):
            c.set("pg/\x00key", b"")
        sock, chan = _raw_session(server.port)
        assert _request(chan, 1, "pg/é".encode(), b"v")[:1] == b"\x02"  # UTF-8 but not ASCII: refused
        assert _request(chan, 1, b"pg/" + b"k" * 65000, b"")[:1] == b"\x02"  # the review's 64 KiB keys
        for i in range(3):  # empty values: only the 250-byte keys count
            c.set(f"pg/{i}" + "k" * 246, b"")
        assert server._bytes == 750
        with pytest.raises(ControlStoreError, match="900-byte limit"):
            c.set("pg/3" + "k" * 246, b"")
        assert c.delete_key("pg/0" + "k" * 246) and server._bytes == 500
        assert not _dropped_now(sock) and server.refusals["request"] >= 4
        sock.close()
    finally:
        server.close()


def test_crafted_requests_are_refused_counted_and_logged_on_one_line(caplog):
    server = ControlStoreServer("127.0.0.1", 0, SECRET, 2)
    try:
        sock, chan = _raw_session(server.port)
        with caplog.at_level("WARNING", logger="flexpipe_dag.runtime.control_store"):
            for key in ("²", "١", "9" * 5000, "", "-1", "٠"):  # not ASCII digits, too long, empty, negative
                assert _request(chan, 11, key.encode())[:1] == b"\x02", key
            assert _request(chan, 12, b"0", "é".encode())[:1] == b"\x02"  # a token with non-ASCII: no TypeError
            assert _request(chan, 12, b"0", b"\xff" * 32)[:1] == b"\x02"
            assert _request(chan, 1, b"pg/x", b"9223372036854775807")[:1] == b"\x00"
            assert _request(chan, 3, b"pg/x", struct.pack(">q", 1))[:1] == b"\x02"  # past int64: refused ...
            assert server.local.get("pg/x") == b"9223372036854775807"  # ... before anything is stored
            assert _request(chan, 1, b"pg/y", b"1" * 4000)[:1] == b"\x00"
            assert _request(chan, 3, b"pg/y", struct.pack(">q", 1))[:1] == b"\x02"
            assert _request(chan, 3, b"pg/z", b"short")[:1] == b"\x02"
            assert _request(chan, 3, b"pg/x", struct.pack(">q", -5))[1:] == struct.pack(">q", (1 << 63) - 6)
        assert not _dropped_now(sock)  # the connection survives every refusal
        assert not server.local.claimed(1) and not server.local.claimed(0)  # "١" is not slot 1
        assert sum(server.refusals.values()) == 11, server.refusals  # every bad request counted
        for record in caplog.records:
            assert record.exc_info is None and "\n" not in record.getMessage(), record.getMessage()
        assert len(caplog.records) == len(server.refusals)  # once per reason
        assert _request(chan, 11, b"1")[:1] == b"\x00" and server.local.claimed(1)  # a real claim still works
        sock.close()
    finally:
        server.close()


# -- --listen spellings (issue #15 review, 8) ------------------------------------------------------
def test_ambiguous_listen_addresses_are_refused_with_one_line(monkeypatch, capsys):
    from flexpipe_dag.cli import main
    from flexpipe_dag.runtime.rendezvous import parse_listen_address

    for text in ("0:29500", "127.1:29500", "0x7f000001:29500", "2130706433:0", "[0:0:0:0:0:0:0:0]:0",
                 "[::ffff:0.0.0.0]:0", "[::ffff:0:0]:0"):  # IPv4-mapped "every interface" too
        with pytest.raises(InputError, match=r"^--listen: .*(numeric shorthand|means every interface)"):
            parse_listen_address(text, "--listen")
    assert parse_listen_address("0.0.0.0:0", "--listen") == ("0.0.0.0", 0)
    assert parse_listen_address("[::]:0", "--listen") == ("::", 0)
    assert parse_listen_address("localhost:29500", "--listen") == ("localhost", 29500)
    with pytest.raises(InputError, match="expected HOST:PORT"):
        parse_listen_address("127.0.0.1:\u0668\u0660", "--listen")  # Arabic-Indic digits are no port
    with pytest.raises(OSError, match="every interface"):
        ControlStoreServer("::ffff:0.0.0.0", 0, SECRET)
    with pytest.raises(OSError, match="numeric shorthand"):
        ControlStoreServer("0", 0, SECRET)  # the Dagster path (control_address) refuses it too
    assert main(["run", "--stages", "2", "--trace", "azure-conv", "--listen", "0:0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--listen" in err[0] and "0.0.0.0" in err[0], err


# -- secret files (issue #15 review, 5 and 9) ------------------------------------------------------
def test_secret_files_are_read_capped_and_warned_about(tmp_path, capsys):
    from flexpipe_dag.runtime.control_auth import MAX_SECRET_FILE_BYTES

    fifo = tmp_path / "fifo.secret"
    os.mkfifo(fifo)
    sparse = tmp_path / "sparse.secret"
    with open(sparse, "wb") as f:
        f.truncate(3 << 30)
    t0 = time.monotonic()
    for path, why in ((fifo, "FIFO"), ("/dev/zero", "device"), (sparse, f"over the {MAX_SECRET_FILE_BYTES} bytes"),
                      (tmp_path, "directory"), (tmp_path / "missing", "not found")):
        with pytest.raises(InputError, match=f"--secret-file: .*{why}") as err:
            read_secret_file(path)
        assert "\n" not in str(err.value)
    assert time.monotonic() - t0 < 2  # nothing hangs or reads gigabytes
    shared = tmp_path / "shared.secret"
    shared.write_text(SECRET + "\n")
    os.chmod(shared, 0o644)
    assert read_secret_file(shared) == SECRET
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "readable by other users" in err_lines[0] and "0644" in err_lines[0]
    os.chmod(shared, 0o600)
    assert read_secret_file(shared) == SECRET and capsys.readouterr().err == ""


def test_a_generated_secret_file_is_written_after_the_bind_and_removed_after_the_run(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.delenv("FLEXPIPE_RUN_SECRET", raising=False)
    monkeypatch.delenv("FLEXPIPE_RUN_SECRET_FILE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    generated = HeadSecret.resolve(None)
    assert generated.path is None and list(tmp_path.iterdir()) == []  # nothing written before the bind
    path = generated.publish()
    assert path is not None and path.parent == tmp_path and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret_file(path) == generated.secret and generated.publish() == path
    generated.discard()
    assert not path.exists()
    named = HeadSecret.resolve(tmp_path / "run.secret")
    assert not (tmp_path / "run.secret").exists()
    named.publish()
    named.discard()
    assert read_secret_file(tmp_path / "run.secret") == named.secret  # the user's file is kept
    existing = HeadSecret.resolve(tmp_path / "run.secret")
    existing.publish()
    existing.discard()
    assert existing.secret == named.secret and (tmp_path / "run.secret").exists()


def test_a_refused_listen_run_writes_no_secret_file(tmp_path, monkeypatch, capsys):
    import tempfile

    from flexpipe_dag.cli import main

    monkeypatch.delenv("FLEXPIPE_RUN_SECRET", raising=False)
    monkeypatch.delenv("FLEXPIPE_RUN_SECRET_FILE", raising=False)
    secrets_dir = tmp_path / "tmp"
    secrets_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(secrets_dir))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        for extra in ([], ["--secret-file", str(tmp_path / "named.secret")]):
            assert main(["run", "--stages", "2", "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl"),
                         "--model", str(checkpoint().path), "--listen", f"127.0.0.1:{port}", *extra]) == 2
            assert "cannot serve the control store" in capsys.readouterr().err
    finally:
        busy.close()
    assert list(secrets_dir.iterdir()) == [] and not (tmp_path / "named.secret").exists()
