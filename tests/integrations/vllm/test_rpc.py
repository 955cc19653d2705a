"""The lookup channel under attack and under failure: a foreign socket or directory at its
path, peers of another uid at either end, a paused worker, silent and garbage connections.
Whatever happens, the scheduler gets a miss in bounded time, never an exception."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.errors import AuthError, InputError, StateError, TransferError, TransferTimeout
from kvtier.integrations.vllm import rpc
from kvtier.integrations.vllm.rpc import Hit, LookupClient, LookupServer
from kvtier.integrations.vllm.scheduler import SchedulerSide
from tests.hosts import needs_root
from tests.integrations.vllm.rpc_peers import MemoryHandler, connect_as, impostor, serve_worker
from tests.server.conftest import SPAWN
from tests.server.server_helpers import SQUATS, identity, squat

NOBODY = 65534
TOKENS = list(range(100))


@pytest.fixture
def directory() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvl-")  # 0700, ours
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def served(directory: str) -> Iterator[tuple[LookupServer, str]]:
    engine_id = f"rpc-{uuid.uuid4().hex}"
    server = LookupServer(engine_id, 0, MemoryHandler(), directory=directory).open()
    yield server, engine_id
    server.close()


def scheduler_for(client: LookupClient) -> SchedulerSide:
    return SchedulerSide([client], block_size=16, chunk_size=16, loads=True, saves=True)


def ask(scheduler: SchedulerSide, rid: str = "r") -> tuple[int, bool]:
    """What vLLM's get_num_new_matched_tokens gets."""
    request = SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS, kv_transfer_params=None)
    return scheduler.num_new_matched_tokens(request, 0)


def test_typed_calls_round_trip(served: tuple[LookupServer, str], directory: str) -> None:
    _server, engine_id = served
    client = LookupClient(engine_id, directory=directory)
    assert client.lookup("a", TOKENS, "tenant-a") == Hit(64, 32)
    assert client.lookup("b", TOKENS) == Hit(64, 32)
    assert [leak.request_id for leak in client.leaks()] == ["a", "b"]
    assert client.end("a") is True and client.end("a") is False
    assert client.stats()["open"] == 1 and client.check() == [] and client.clear() == {"cpu": 0}
    assert client.flush(1.0) is True
    for bad in (math.nan, -5.0, math.inf):
        with pytest.raises(InputError, match="flush timeout"):
            client.flush(bad)
    client.close()


def test_a_flush_with_a_bad_timeout_on_the_wire_is_refused(
    served: tuple[LookupServer, str], directory: str
) -> None:
    """A peer that skips the client's check still gets Failed, not a flush."""
    server, engine_id = served
    sock = hello(server, engine_id)
    for bad in (math.nan, -5.0):
        sock.sendall(rpc.FRAMING.encode(rpc.Flush(bad)))
        reply = rpc.reader(sock).read(time.monotonic() + 5)
        assert isinstance(reply, rpc.Failed) and "flush timeout" in reply.message
    sock.close()


def hello(server: LookupServer, engine_id: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(server.path))
    sock.sendall(rpc.FRAMING.encode(rpc.Hello(rpc.VERSION, engine_id)))
    assert isinstance(rpc.reader(sock).read(time.monotonic() + 5), rpc.Welcome)
    return sock


def test_a_foreign_socket_at_the_path_is_a_miss_logged_once(
    directory: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Something of our own uid listens at the path but speaks another protocol (a stale
    program, multiprocessing's auth challenge): every lookup is a miss, one log line."""
    engine_id = f"rpc-{uuid.uuid4().hex}"
    path = str(rpc.socket_path(engine_id, 0, directory))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)

    def answer_garbage() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"\x00\x00\x00\x14#CHALLENGE#" + os.urandom(20))
            conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    scheduler = scheduler_for(LookupClient(engine_id, directory=directory, timeout=2.0))
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.scheduler"):
        for i in range(5):
            assert ask(scheduler, f"r{i}") == (0, False)
            scheduler.finished(f"r{i}")  # the end fails too: no exception either
    lookups = [r for r in caplog.records if "treating as a miss" in r.getMessage()]
    assert len(lookups) == 1, [r.getMessage() for r in caplog.records]
    listener.close()


@needs_root
def test_a_directory_of_another_user_or_writable_by_others_is_refused(
    directory: str,
) -> None:
    engine_id = f"rpc-{uuid.uuid4().hex}"
    for mode, owner in (
        (0o777, os.geteuid()),
        (0o700, NOBODY),
        (0o770, os.geteuid()),
        (0o755, os.geteuid()),
    ):
        shared = os.path.join(directory, f"d{mode:o}-{owner}")
        os.mkdir(shared)
        os.chmod(shared, mode)
        os.chown(shared, owner, -1)
        with pytest.raises(StateError, match="socket directory"):
            LookupServer(engine_id, 0, MemoryHandler(), directory=shared).open()
        client = LookupClient(engine_id, directory=shared, timeout=2.0)
        with pytest.raises(TransferError, match="socket directory"):
            client.lookup("r", TOKENS)
        assert ask(scheduler_for(client)) == (0, False)
    # the default directory is made 0700 and ours
    private = os.path.join(directory, "fresh")
    server = LookupServer(engine_id, 0, MemoryHandler(), directory=private).open()
    assert os.stat(private).st_mode & 0o777 == 0o700
    assert os.stat(server.path).st_mode & 0o777 == 0o600
    server.close()


@pytest.fixture
def default_tmp(directory: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """$TMPDIR for the channel's default directory, without $XDG_RUNTIME_DIR."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", directory)
    return directory


@pytest.mark.parametrize("how", SQUATS)
def test_a_squatted_default_directory_is_stepped_around_by_both_ends(
    default_tmp: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user made $TMPDIR/kvtier-vllm-<uid> first: the worker listens in kvtier's own
    private directory beside it, the scheduler (asking first, as it does while the worker
    registers its caches) finds it there, and the squatter's entry is left alone."""
    squatted = os.path.join(default_tmp, f"kvtier-vllm-{os.geteuid()}")
    squat(squatted, how)
    before = os.lstat(squatted)
    engine_id = f"rpc-{uuid.uuid4().hex}"
    client = LookupClient(engine_id, timeout=10.0)
    handler = MemoryHandler()
    opened: list[LookupServer] = []
    late = threading.Timer(0.3, lambda: opened.append(LookupServer(engine_id, 0, handler).open()))
    late.start()
    try:
        assert client.lookup("r", TOKENS) == Hit(handler.hit, handler.cpu)
        late.join()
        (server,) = opened
        moved = str(server.path.parent)
        assert moved.startswith(squatted + ".") and client.path == server.path
        info = os.stat(moved)
        assert (info.st_uid, info.st_mode & 0o777) == (os.geteuid(), 0o700)
        assert squatted in caplog.text and moved in caplog.text
        assert ask(scheduler_for(LookupClient(engine_id)), "r2")[0] == handler.hit
    finally:
        late.join()
        for server in opened:
            server.close()
    assert identity(os.lstat(squatted)) == identity(before)  # the squatter's, untouched


@needs_root
def test_the_channel_prefers_xdg_runtime_dir(
    default_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = os.path.join(default_tmp, "run-user")
    os.mkdir(runtime, 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    engine_id = f"rpc-{uuid.uuid4().hex}"
    with contextlib.closing(LookupServer(engine_id, 0, MemoryHandler()).open()) as server:
        assert server.path.parent == Path(runtime) / "kvtier-vllm"
        assert LookupClient(engine_id).stats() is not None
    os.chown(runtime, NOBODY, -1)  # not ours: not trusted as the runtime directory
    assert rpc.socket_path(engine_id).parent == Path(default_tmp) / f"kvtier-vllm-{os.geteuid()}"


def test_with_no_directory_to_be_had_the_error_names_it_its_owner_and_the_setting(
    default_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = os.path.join(default_tmp, "a-file")
    with open(blocker, "w") as f:
        f.write("x")
    monkeypatch.setattr(tempfile, "tempdir", blocker)
    with pytest.raises(StateError) as refused:
        LookupServer(f"rpc-{uuid.uuid4().hex}", 0, MemoryHandler()).open()
    for part in (os.path.join(blocker, f"kvtier-vllm-{os.geteuid()}"), "owned by", "TMPDIR"):
        assert part in str(refused.value)


@needs_root
def test_a_worker_of_another_uid_is_never_trusted(directory: str) -> None:
    """An impostor that answers perfectly (Welcome, then a 1M-token hit) but runs as
    another uid: the client refuses it on SO_PEERCRED before reading a byte from it."""
    engine_id = f"rpc-{uuid.uuid4().hex}"
    path = str(rpc.socket_path(engine_id, 0, directory))
    ready = SPAWN.Queue()
    child = SPAWN.Process(target=impostor, args=(path, NOBODY, ready), daemon=True)
    child.start()
    try:
        assert ready.get(timeout=60) == NOBODY
        client = LookupClient(engine_id, directory=directory, timeout=5.0)
        with pytest.raises(AuthError, match=f"uid {NOBODY}"):
            client.lookup("r", TOKENS)
        assert ask(scheduler_for(client)) == (0, False)
        trusting = LookupClient(engine_id, directory=directory, peer_uid=NOBODY)
        assert trusting.lookup("r", TOKENS) == Hit(1 << 20, 1 << 20)  # a configured uid is ok
    finally:
        child.kill()
        child.join(10)


@needs_root
def test_a_client_of_another_uid_is_refused(
    served: tuple[LookupServer, str], directory: str
) -> None:
    """Even with the modes loosened (the directory searchable, the socket 0666), a peer of
    another uid gets no Welcome: the worker checks SO_PEERCRED before reading anything."""
    server, engine_id = served
    os.chmod(directory, 0o711)
    os.chmod(server.path, 0o666)
    out = SPAWN.Queue()
    child = SPAWN.Process(target=connect_as, args=(NOBODY, str(server.path), engine_id, out))
    child.start()
    got = out.get(timeout=60)
    child.join(10)
    assert "Welcome" not in got and server.refused == 1, got
    os.chmod(directory, 0o700)  # a client refuses a directory others can reach
    assert LookupClient(engine_id, directory=directory).lookup("r", TOKENS) == Hit(64, 32)


@pytest.fixture
def worker_process(directory: str) -> Iterator[tuple[Any, str]]:
    engine_id = f"rpc-{uuid.uuid4().hex}"
    ready = SPAWN.Queue()
    child = SPAWN.Process(target=serve_worker, args=(engine_id, directory, ready), daemon=True)
    child.start()
    ready.get(timeout=60)
    yield child, engine_id
    os.kill(child.pid, signal.SIGCONT)
    child.kill()
    child.join(10)


def wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (SIGSTOP reaches each one in its own time)."""
    deadline = time.monotonic() + 30
    while True:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.add(f.read().rsplit(")", 1)[1].split()[0])
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.05)


def test_a_paused_worker_makes_every_call_fail_in_bounded_time(
    worker_process: tuple[Any, str], directory: str
) -> None:
    """SIGSTOP the worker: the call in flight, a reconnecting call and a concurrent end
    each fail within their deadline (none waits forever on another); SIGCONT and the same
    client works again."""
    child, engine_id = worker_process
    client = LookupClient(engine_id, directory=directory, timeout=1.0)
    assert client.lookup("warm", TOKENS) == Hit(64, 32)
    os.kill(child.pid, signal.SIGSTOP)
    wait_stopped(child.pid)
    slack = 8.0  # the machine is loaded; the point is "returns", not how fast
    for _ in range(2):  # the second one reconnects: today's code blocked here for good
        started = time.monotonic()
        with pytest.raises(TransferTimeout):
            client.lookup("r", TOKENS)
        assert time.monotonic() - started < slack
    results: list[str] = []

    def end() -> None:
        try:
            client.end("warm")
            results.append("ended")
        except TransferError as exc:
            results.append(type(exc).__name__)

    enders = [threading.Thread(target=end) for _ in range(3)]
    started = time.monotonic()
    for thread in enders:
        thread.start()
    for thread in enders:
        thread.join(slack * 3)
    assert results == ["TransferTimeout"] * 3 and time.monotonic() - started < slack * 3
    scheduler = scheduler_for(client)
    assert ask(scheduler) == (0, False)
    os.kill(child.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:
        try:
            assert client.lookup("back", TOKENS, timeout=5.0) == Hit(64, 32)
            break
        except TransferTimeout:
            assert time.monotonic() < deadline


def test_silent_connections_do_not_block_accepts(
    served: tuple[LookupServer, str], directory: str
) -> None:
    """Peers that connect and say nothing: a real client is still served at once, and the
    silent ones are closed at the Hello deadline."""
    server, engine_id = served
    silent = []
    for _ in range(5):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(server.path))
        silent.append(sock)
    started = time.monotonic()
    client = LookupClient(engine_id, directory=directory, timeout=10.0)
    assert client.lookup("r", TOKENS) == Hit(64, 32)
    assert time.monotonic() - started < rpc.HELLO_TIMEOUT_S  # not behind the silent ones
    for sock in silent:
        sock.settimeout(rpc.HELLO_TIMEOUT_S + 20)
        assert sock.recv(16) == b""  # closed by the worker, not left open forever
        sock.close()


def test_garbage_frames_close_only_that_connection(
    served: tuple[LookupServer, str], directory: str
) -> None:
    server, engine_id = served
    client = LookupClient(engine_id, directory=directory)
    assert client.lookup("r", TOKENS) == Hit(64, 32)
    bodies = [
        b"GET / HTTP/1.1\r\n\r\n",
        rpc.HEADER.pack(rpc.MAGIC, rpc.VERSION, 1 << 30),  # announces 1 GiB
        rpc.HEADER.pack(rpc.MAGIC, rpc.VERSION, 4) + b"\xc1\xc1\xc1\xc1",  # not msgpack
        rpc.FRAMING.encode(rpc.Hit(1, 1)),  # a reply where a Hello belongs
        b"\x80\x03cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.",  # a pickle
    ]
    for body in bodies:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(server.path))
        sock.sendall(body)
        assert sock.recv(1 << 16) == b"", body  # closed, no answer
        sock.close()
    assert client.lookup("r2", TOKENS) == Hit(64, 32)  # the good connection never noticed


def test_a_version_mismatch_is_refused_with_a_reason(
    served: tuple[LookupServer, str],
) -> None:
    server, engine_id = served
    for hello_msg, reason in (
        (rpc.Hello(rpc.VERSION + 1, engine_id), "version"),
        (rpc.Hello(rpc.VERSION, "someone-else"), "serves engine"),
    ):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(server.path))
        sock.sendall(rpc.FRAMING.encode(hello_msg))
        reply = rpc.reader(sock).read(time.monotonic() + 5)
        assert isinstance(reply, rpc.Refused) and reason in reply.reason
        sock.close()


def test_a_stale_socket_is_replaced_but_nothing_else_is_deleted(directory: str) -> None:
    engine_id = f"rpc-{uuid.uuid4().hex}"
    path = rpc.socket_path(engine_id, 0, directory)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # what a killed worker leaves
    LookupServer(engine_id, 0, MemoryHandler(), directory=directory).open().close()
    path.write_text("precious")
    with pytest.raises(StateError, match="not a socket"):
        LookupServer(engine_id, 0, MemoryHandler(), directory=directory).open()
    assert path.read_text() == "precious"
