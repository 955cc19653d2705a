"""No local process of another user can pose as the kvtier server, and the server's socket
path never costs anyone a file: the default directory is private, the client checks the
server's uid before trusting a byte, and only a stale socket of our own is replaced."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from collections.abc import Iterator

import pytest

from kvtier.config import Config
from kvtier.errors import ConfigError, StateError
from kvtier.server import endpoint
from kvtier.server.daemon import KVTierServer
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_tokens
from tests.server.conftest import SPAWN
from tests.server.server_helpers import open_client, remove_tempdir, short_tempdir
from tests.server.workers import impostor_server

NOBODY = 65534


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A world-writable directory, as /tmp is: where another user can bind a name first."""
    path = short_tempdir()
    os.chmod(path, 0o1777)
    yield path
    remove_tempdir(path)


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
        assert client.lookup(make_tokens(64, 7), "r") == 0
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


def test_the_default_directory_is_private_and_a_foreign_one_is_refused(
    private_tmp: str,
) -> None:
    cfg = Config.load(env={})
    default = endpoint.socket_path(cfg)
    directory = os.path.dirname(default)
    assert directory == os.path.join(private_tmp, f"kvtier-{os.geteuid()}")
    for mode, owner in ((0o777, NOBODY), (0o700, NOBODY), (0o777, os.geteuid())):
        os.makedirs(directory, exist_ok=True)
        os.chmod(directory, mode)
        os.chown(directory, owner, -1)
        with pytest.raises(StateError, match="socket directory"):
            KVTierServer(cfg).open()
        os.rmdir(directory)
    with KVTierServer(cfg) as server:
        assert server.path == default
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(default).st_mode) == 0o600


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
