"""No local process of another user can pose as the kvtier server, and the server's socket
path never costs anyone a file: the default directory is private, the client checks the
server's uid before trusting a byte, and only a stale socket of our own is replaced."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtier import local_sockets
from kvtier.config import Config
from kvtier.errors import ConfigError, StateError
from kvtier.server import endpoint
from kvtier.server.client import ServerClient
from kvtier.server.daemon import KVTierServer
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_tokens
from tests.hosts import needs_root
from tests.server.conftest import SPAWN
from tests.server.server_helpers import (
    CHUNK_BYTES,
    NOBODY,
    SQUATS,
    client_config,
    identity,
    open_client,
    remove_tempdir,
    short_tempdir,
    squat,
)
from tests.server.workers import impostor_server


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A world-writable directory, as /tmp is: where another user can bind a name first."""
    path = short_tempdir()
    os.chmod(path, 0o1777)
    yield path
    remove_tempdir(path)


@needs_root
def test_a_server_of_another_uid_is_never_trusted(shared_dir: str) -> None:
    """Another user bound the path first and answers like a server (a Welcome with its own
    memfd, a hit for every lookup): the client refuses it on SO_PEERCRED, maps nothing and
    serves misses."""
    path = os.path.join(shared_dir, "kvtier.sock")
    out = SPAWN.Queue()
    page_bytes = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)
    child = SPAWN.Process(target=impostor_server, args=(NOBODY, path, page_bytes, out), daemon=True)
    child.start()
    try:
        assert out.get(timeout=60) == "listening"
        client = open_client(f"unix://{path}")
        assert client.lookup(make_tokens(64, 7), "r").tokens == 0
        assert not client.connected
        assert f"uid {NOBODY}" in client._link.last_error
        assert client._link.pages is None  # its memfd was never mapped
        client.close()
    finally:
        child.kill()
        child.join(10)


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """$TMPDIR for the default socket path, without $XDG_RUNTIME_DIR."""
    path = short_tempdir()
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", path)
    yield path
    remove_tempdir(path)


def server_config() -> Config:
    return Config.load(overrides={"max_local_cpu_size": f"{16 * CHUNK_BYTES}B"}, env={})


def test_the_default_directory_is_private(private_tmp: str) -> None:
    cfg = Config.load(env={})
    default = endpoint.socket_path(cfg)
    directory = os.path.dirname(default)
    assert directory == os.path.join(private_tmp, f"kvtier-{os.geteuid()}")
    with KVTierServer(cfg) as server:
        assert server.path == default
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(default).st_mode) == 0o600


@pytest.mark.parametrize("how", SQUATS)
def test_a_squatted_default_directory_is_stepped_around_and_clients_find_the_server(
    private_tmp: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user made $TMPDIR/kvtier-<uid> first: the server listens in a private
    directory of its own beside it (one warning naming the squatter), a client with the
    default path finds it there, and the squatter's entry is left as it was."""
    cfg = server_config()
    squatted = os.path.join(private_tmp, f"kvtier-{os.geteuid()}")
    squat(squatted, how)
    before = os.lstat(squatted)
    tokens = make_tokens(2 * SMALL_CHUNK, 3)
    with KVTierServer(cfg) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        moved = os.path.dirname(server.path)
        assert moved.startswith(squatted + ".") and os.path.basename(server.path) == "kvtier.sock"
        info = os.stat(moved)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.geteuid(), 0o700)
        assert squatted in caplog.text and moved in caplog.text
        client = ServerClient(None, SMALL_LAYOUT, model_name="m", config=client_config())
        with client.open():
            assert client._link.path == server.path and client.connected
            client.store(tokens, torch.ones(SMALL_LAYOUT.kv_shape(2 * SMALL_CHUNK)))
            assert client.flush(30)
            assert client.lookup(tokens, "r").tokens == 2 * SMALL_CHUNK
        server.stop()
    assert identity(os.lstat(squatted)) == identity(before)  # the squatter's, untouched
    with KVTierServer(cfg) as again:  # the next start reuses that directory, makes no other
        assert os.path.dirname(again.path) == moved
    assert local_sockets.fallbacks(squatted) == [moved]


@needs_root
def test_a_client_started_first_finds_a_server_that_stepped_aside_later(
    private_tmp: str,
) -> None:
    squatted = os.path.join(private_tmp, f"kvtier-{os.geteuid()}")
    squat(squatted, "nobody-0700")
    client = ServerClient(None, SMALL_LAYOUT, model_name="m", config=client_config())
    with client.open():
        assert client.lookup(make_tokens(SMALL_CHUNK, 1), "r0").tokens == 0  # nobody there yet
        assert not client.connected
        with KVTierServer(server_config()) as server:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            deadline = time.monotonic() + 10
            while not client.connected and time.monotonic() < deadline:
                client.lookup(make_tokens(SMALL_CHUNK, 1), "r1")
                time.sleep(0.05)
            assert client.connected and client._link.path == server.path
            server.stop()


@needs_root
def test_a_squatted_directory_with_no_way_on_names_it_its_owner_and_the_setting(
    private_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit server_socket is the operator's choice: never moved, refused with the
    directory, its owner and the setting. Where no directory can be made at all, the same."""
    squatted = os.path.join(private_tmp, "chosen")
    squat(squatted, "nobody-0700")
    cfg = Config.load(env={"KVTIER_SERVER_SOCKET": os.path.join(squatted, "k.sock")})
    with pytest.raises(StateError) as refused:
        KVTierServer(cfg).open()
    for part in (squatted, f"uid {NOBODY} (nobody)", "server_socket"):
        assert part in str(refused.value)
    blocker = os.path.join(private_tmp, "not-a-directory")
    with open(blocker, "w") as f:
        f.write("x")
    monkeypatch.setattr(
        tempfile, "tempdir", blocker
    )  # $TMPDIR is a file: nothing can be made in it
    with pytest.raises(StateError) as nowhere:
        KVTierServer(Config.load(env={})).open()
    for part in (os.path.join(blocker, f"kvtier-{os.geteuid()}"), "XDG_RUNTIME_DIR", "TMPDIR"):
        assert part in str(nowhere.value)


@needs_root
def test_socket_path_never_deletes_what_is_not_our_stale_socket(tempdir: str) -> None:
    cfg = Config.load(env={})
    path = os.path.join(tempdir, "kvtier.sock")
    with open(path, "w") as f:
        f.write("precious")
    with pytest.raises(StateError, match="not a socket"):
        KVTierServer(cfg, socket_path=path).open()
    with open(path) as f:
        assert f.read() == "precious"
    os.unlink(path)
    os.mkdir(path)
    with pytest.raises(StateError, match="is a directory"):
        KVTierServer(cfg, socket_path=path).open()
    os.rmdir(path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    os.chown(path, NOBODY, -1)  # another user's leftover: not ours to remove
    with pytest.raises(StateError, match="belongs to uid"):
        KVTierServer(cfg, socket_path=path).open()
    assert os.path.exists(path)
    os.chown(path, os.geteuid(), -1)  # our own stale socket: replaced
    KVTierServer(cfg, socket_path=path).open().close()
    assert not os.path.exists(path)  # and removed at close


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_socket_setting_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="server_socket"):
        Config.load(env={"KVTIER_SERVER_SOCKET": value})
