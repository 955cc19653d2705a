"""Bad peers harm nobody else: garbage, truncated, oversized, wrong-version and out-of-order
messages from a raw socket; too many clients; another user."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from kvtier.fingerprint import Fingerprint
from kvtier.layout import dtype_name
from kvtier.server import protocol as wire
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens
from tests.hosts import needs_root
from tests.server.conftest import SPAWN
from tests.server.server_helpers import (
    IDLE,
    ServerProcess,
    idle_server_state,
    open_client,
    remove_tempdir,
    short_tempdir,
    wait_until,
)
from tests.server.workers import connect_as


def hello(model_name: str = "test-model", **changes: object) -> wire.Hello:
    fingerprint = Fingerprint(model_name=model_name, layout=SMALL_LAYOUT, chunk_size=SMALL_CHUNK)
    fields: dict[str, object] = {
        "version": wire.VERSION,
        "fingerprint": fingerprint.hex(),
        "model_name": model_name,
        "num_layers": SMALL_LAYOUT.num_layers,
        "num_kv_heads": SMALL_LAYOUT.num_kv_heads,
        "head_dim": SMALL_LAYOUT.head_dim,
        "dtype": dtype_name(SMALL_LAYOUT.dtype),
        "chunk_size": SMALL_CHUNK,
        "hash_algorithm": "xxh3_128",
        "tp_rank": 0,
        "tp_world_size": 1,
        "cache_salt": "",
        "save_unfull_chunk": False,
    }
    fields.update(changes)
    return wire.Hello(**fields)  # type: ignore[arg-type]


def raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def handshake(path: str) -> socket.socket:
    sock = raw(path)
    wire.send(sock, hello())
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
    for fd in fds:
        os.close(fd)
    reader = wire.reader(sock)
    reader.feed(data)
    assert isinstance(reader.read(), wire.Welcome)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed its end (EOF, or a reset)."""
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def frame(body: bytes, *, magic: bytes = wire.MAGIC, version: int = wire.VERSION,
          length: int | None = None) -> bytes:  # fmt: skip
    return wire.HEADER.pack(magic, version, len(body) if length is None else length) + body


BAD_FRAMES = {
    "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad frame magic"),
    "truncated header": (b"KVS\x01", "truncated frame header"),
    "truncated body": (frame(b"\x81" * 10, length=100), "truncated frame body"),
    "oversized": (frame(b"", length=wire.MAX_BODY_BYTES + 1), "exceeds the"),
    "wrong version": (frame(wire.encode(hello())[wire.HEADER.size :], version=9), "version 9"),
    "malformed body": (frame(b"\xc1\xc1\xc1"), "malformed message"),
    "not a message": (frame(b"\x81\xa4type\xa5Bogus"), "malformed message"),
    "lookup before hello": (wire.encode(wire.Lookup("r", b"\0\0\0\0")), "expected Hello first"),
    "hello of version 2": (wire.encode(hello(version=2)), "protocol version 2"),
}


@pytest.fixture(scope="module")
def victim(server: ServerProcess) -> Iterator[object]:
    """A well-behaved client, with a pinned prefix, that must not notice any of this."""
    tokens = make_tokens(64, 77)
    client = open_client(server.url)
    client.store(tokens, make_kv(64, 77))
    assert client.lookup(tokens, "victim").tokens == 64
    yield client
    client.end_request("victim")
    assert idle_server_state(client) == IDLE
    client.close()


def assert_victim_fine(victim: object) -> None:
    from kvtier.server.client import ServerClient

    assert isinstance(victim, ServerClient)
    assert victim.lookup(make_tokens(64, 77), "victim-again").tokens == 64
    assert victim.end_request("victim-again")
    assert victim.stats()["connects"] == 1  # never reconnected: its connection was untouched
    assert victim.check_invariants() == []


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_bad_frames_close_only_that_connection(
    server: ServerProcess, victim: object, name: str
) -> None:
    data, error = BAD_FRAMES[name]
    sock = raw(server.path)
    sock.sendall(data)
    if name.startswith("truncated"):
        sock.shutdown(socket.SHUT_WR)  # the peer hangs up in the middle of its frame
    assert closed_by_server(sock)
    wait_until(lambda: error in server.log(), what=f"{error!r} in the server log")
    assert_victim_fine(victim)


OUT_OF_ORDER = {
    "commit without reserve": (wire.Commit(7), "never reserved"),
    "second hello": (hello(), "second Hello"),
    "a reply sent as a request": (wire.Hit(3), "is a server message"),
    "tokens not whole int32": (wire.Lookup("r", b"\0\0\0"), "not whole int32"),
}


@pytest.mark.parametrize("name", list(OUT_OF_ORDER))
def test_out_of_order_after_the_handshake(server: ServerProcess, victim: object, name: str) -> None:
    message, error = OUT_OF_ORDER[name]
    sock = handshake(server.path)
    tokens = struct.pack("<16i", *range(16))
    wire.send(sock, wire.Lookup("held-by-bad-client", tokens))  # something to release
    assert isinstance(wire.reader(sock).read(), wire.Hit)
    wire.send(sock, message)
    assert closed_by_server(sock)
    wait_until(lambda: error in server.log(), what=f"{error!r} in the server log")
    assert_victim_fine(victim)


def test_a_second_reserve_before_commit_is_refused(server: ServerProcess, victim: object) -> None:
    sock = handshake(server.path)
    reader = wire.reader(sock)
    tokens = struct.pack("<32i", *range(100, 132))
    wire.send(sock, wire.Reserve(1, tokens))
    reply = reader.read()
    assert isinstance(reply, wire.Pages) and len(reply.pages) == 2
    wire.send(sock, wire.Reserve(2, tokens))
    assert closed_by_server(sock)
    wait_until(lambda: "while store 1 is not committed" in server.log(), what="the error")
    assert_victim_fine(victim)  # its invariants hold: the reserved pages went back


@pytest.mark.parametrize("claimed", ["0" * 32, hello().fingerprint])
def test_fingerprint_that_does_not_match_its_fields_is_refused(
    server: ServerProcess, victim: object, claimed: str
) -> None:
    """Also when it claims a model being served (the victim's): no pages of another model."""
    sock = raw(server.path)
    wire.send(sock, hello(model_name="intruder", fingerprint=claimed))
    reply = wire.reader(sock).read()
    assert isinstance(reply, wire.Refused) and "fingerprint mismatch" in reply.message
    assert closed_by_server(sock)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"dtype": "float13"}, "float13"),
        ({"hash_algorithm": "md5"}, "pre_caching_hash_algorithm"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_a_hello_the_server_cannot_serve_is_refused_with_the_reason(
    server: ServerProcess, victim: object, changes: dict[str, object], error: str
) -> None:
    sock = raw(server.path)
    wire.send(sock, hello(**changes))
    reply = wire.reader(sock).read()
    assert isinstance(reply, wire.Refused) and error in reply.message
    assert closed_by_server(sock)
    assert_victim_fine(victim)


def test_many_clients_at_once_are_bounded() -> None:
    directory = short_tempdir()
    proc = ServerProcess(directory, max_local_cpu_size="1MiB", server_max_clients=4).start()
    try:
        clients = []
        barrier = threading.Barrier(12)

        def join() -> None:
            barrier.wait()
            clients.append(open_client(proc.url, max_backoff=60.0))

        threads = [threading.Thread(target=join) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        served = [c for c in clients if c.connected]
        refused = [c for c in clients if not c.connected]
        assert (len(served), len(refused)) == (4, 8)
        tokens = make_tokens(32, 5)
        assert served[0].store(tokens, make_kv(32, 5)) == 2
        assert all(c.lookup(tokens, "x").tokens == 32 for c in served)
        assert all(c.lookup(tokens, "x").tokens == 0 for c in refused)  # a miss, not an error
        assert "server full: 4 clients connected" in proc.log()
        for c in served:
            c.close()
        for c in refused:
            c.close()
    finally:
        proc.stop()
        remove_tempdir(directory)


@needs_root
def test_another_user_is_refused_even_with_an_open_socket_mode(server: ServerProcess) -> None:
    """The peer is a child that becomes uid 65534 (``setgid``/``setuid`` need root), the only
    way one machine has a peer of another uid (tests/hosts.py: fails under ``KVTIER_CI``
    without root, so the refusal of other uids cannot go untested)."""
    os.chmod(server.directory, 0o755)
    os.chmod(server.path, 0o666)  # a loosened mode: the uid check still keeps others out
    try:
        results = SPAWN.Queue()
        other = SPAWN.Process(target=connect_as, args=(65534, server.path, results))
        other.start()
        answer = results.get(timeout=60)
        other.join(30)
        assert "Refused" in answer and "uid 65534" in answer
        os.chmod(server.path, 0o600)
        other = SPAWN.Process(target=connect_as, args=(65534, server.path, results))
        other.start()
        answer = results.get(timeout=60)
        other.join(30)
        assert "Permission denied" in answer  # the file mode alone keeps it out
    finally:
        os.chmod(server.path, 0o600)
        os.chmod(server.directory, 0o700)
