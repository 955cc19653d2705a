"""The wire format and the socket file, without a server process."""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest

from kvtier import Config, ConfigError, ProtocolError, StateError
from kvtier.server import endpoint
from kvtier.server import protocol as wire


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def test_frames_round_trip_and_split_anywhere() -> None:
    a, b = pair()
    messages = [
        wire.Lookup("r1", b"\x01\x00\x00\x00" * 300, 16),
        wire.Pages(32, [4, 9], [0, 16], [16, 16]),
        wire.StatsReply({"tiers": {"cpu": {"entries": 3}}, "hit": 1.5}),
    ]
    data = b"".join(wire.encode(m) for m in messages)
    reader = wire.reader(b)

    def send_in_pieces() -> None:  # frames cut at every odd place, and two in one read
        for i in range(0, len(data), 7):
            a.sendall(data[i : i + 7])
        a.close()

    sender = threading.Thread(target=send_in_pieces)
    sender.start()
    assert [reader.read() for _ in messages] == messages
    sender.join(5)
    assert reader.read() is None  # EOF between frames: a clean close


def test_a_stalled_frame_is_truncated_not_a_hang() -> None:
    a, b = pair()
    reader = wire.reader(b, stall_timeout=0.2)
    a.sendall(wire.encode(wire.EndRequest("r"))[:6])
    with pytest.raises(ProtocolError, match="stalled"):
        reader.read()


def test_an_oversized_message_is_refused_by_the_sender_too() -> None:
    with pytest.raises(ProtocolError, match="limit"):
        wire.encode(wire.Lookup("r", b"\0" * (wire.MAX_BODY_BYTES + 1)))


def test_socket_path_defaults_and_urls(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    cfg = Config.load(env={})
    assert endpoint.socket_path(cfg, "unix:///run/x.sock") == "/run/x.sock"
    assert endpoint.socket_path(cfg.with_overrides(server_socket="/a/b.sock")) == "/a/b.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert endpoint.socket_path(cfg) == os.path.join(str(tmp_path), "kvtier.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert endpoint.socket_path(cfg) == f"/tmp/kvtier-{os.getuid()}/kvtier.sock"
    with pytest.raises(ConfigError, match="server_socket"):
        endpoint.socket_path(cfg, "unix://relative.sock")


def test_listen_is_private_replaces_a_stale_file_and_refuses_a_live_one() -> None:
    import tempfile

    directory = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    path = os.path.join(directory, "sub", "k.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.makedirs(os.path.dirname(path))
    stale.bind(path)
    stale.close()  # the file stays, nobody listens: what a killed server leaves
    _, live = endpoint.listen(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        accepted = threading.Thread(target=lambda: live.accept()[0].close())
        accepted.start()
        with pytest.raises(StateError, match="already listening"):
            endpoint.listen(path)
        accepted.join(5)
    finally:
        live.close()
        endpoint.remove(path)
        os.rmdir(os.path.dirname(path))
        os.rmdir(directory)


def test_a_missing_parent_is_named_as_missing(tmp_path: object) -> None:
    """``kvtier server --socket A/B/x.sock`` with A missing: not "is not a directory" (issue
    58, item 10). The server makes the socket's own directory, never the ones above it."""
    missing = os.path.join(str(tmp_path), "A")
    path = os.path.join(missing, "B", "x.sock")
    with pytest.raises(StateError, match=f"its parent {missing} does not exist") as caught:
        endpoint.listen(path)
    assert f"mkdir -p {missing}" in str(caught.value) and "--socket" in str(caught.value)
    assert not os.path.lexists(missing)
    with open(missing, "w"):  # a file where the parent should be: that is "not a directory"
        pass
    with pytest.raises(StateError, match="not a directory"):
        endpoint.listen(path)
