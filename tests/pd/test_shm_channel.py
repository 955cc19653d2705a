"""The shm sender writes only into a segment of its own user that a receiver *named*: a hostile
receiver (another local user listening on the decoder's port, or dialing a prefiller's
xPyD source) cannot make it map a file of its choosing, and a segment shrunk under the
sender is a refused chunk, not a SIGBUS.

The hostile HelloReply is built from raw msgpack with both the old ``shm_path`` field and
``shm_segment``, as a peer on the wire can send any fields: a sender reading either one is
tested by the same bytes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from kvtier.errors import TransferError
from kvtier.pd.channels.shm import SHM_DIR, ShmReceiver, ShmSender
from kvtier.pd.channels.shm_segments import NAME, PREFIX
from kvtier.pd.protocol import Hello, HelloReply
from tests.hosts import needs_root

PAGE = 4096
NOBODY = 65534  # another local user
CONTENT = b"precious" * (PAGE // 8)


def hostile_reply(target: str, pages: int = 1) -> HelloReply:
    """A HelloReply that names ``target`` however a sender may read it: as a path (the
    /dev/shm/ prefix kept, as the old check wanted) and as a segment name."""
    shm_path = target if target.startswith(SHM_DIR + "/") else f"{SHM_DIR}/../..{target}"
    raw = msgspec.msgpack.encode(
        {
            "type": "HelloReply",
            "num_pages": pages,
            "page_bytes": PAGE,
            "shm_path": shm_path,
            "shm_segment": os.path.basename(target) if target.startswith(SHM_DIR) else shm_path,
        }
    )
    return msgspec.msgpack.decode(raw, type=HelloReply)


def attach_refused(reply: HelloReply, match: str) -> None:
    sender = ShmSender()
    try:
        with pytest.raises(TransferError, match=match):
            sender.attach(reply)
    finally:
        sender.close()


@pytest.fixture
def in_shm() -> Iterator[list[str]]:
    """Paths the test puts in /dev/shm; removed afterwards."""
    made: list[str] = []
    yield made
    for path in made:
        if os.path.lexists(path):
            os.unlink(path)


def segment_like_name() -> str:
    return f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"


def test_the_receiver_names_its_segment_never_a_path() -> None:
    receiver = ShmReceiver()
    try:
        receiver.make_pool(2, PAGE)
        offered = HelloReply(2, PAGE, **receiver.greet(Hello("f", PAGE, 1, "shm")))
        assert NAME.fullmatch(offered.shm_segment) and "/" not in offered.shm_segment
        assert os.path.join(SHM_DIR, offered.shm_segment) == receiver.shm_path
    finally:
        receiver.close()


def test_a_path_out_of_dev_shm_is_never_opened(tmp_path: Path) -> None:
    """/dev/shm/../../<file> passed the old prefix check: the sender wrote KV into the file."""
    victim = tmp_path / "root-only"
    victim.write_bytes(CONTENT)
    victim.chmod(0o600)
    attach_refused(hostile_reply(str(victim)), "no shared-memory segment kvtier makes")
    assert victim.read_bytes() == CONTENT


@needs_root
def test_another_users_segment_is_never_mapped(in_shm: list[str]) -> None:
    """A segment made by another user (a decoder impostor) is refused before the map: mapped,
    its owner could truncate it and kill the prefiller with SIGBUS."""
    theirs = os.path.join(SHM_DIR, segment_like_name())
    in_shm.append(theirs)
    with open(theirs, "wb") as f:
        f.write(CONTENT)
    os.chown(theirs, NOBODY, NOBODY)
    attach_refused(hostile_reply(theirs), "owned by uid 65534")


def test_a_link_named_like_a_segment_is_not_followed(tmp_path: Path, in_shm: list[str]) -> None:
    victim = tmp_path / "root-only"
    victim.write_bytes(CONTENT)
    link = os.path.join(SHM_DIR, segment_like_name())
    in_shm.append(link)
    os.symlink(victim, link)
    attach_refused(hostile_reply(link), "cannot open")
    assert victim.read_bytes() == CONTENT


def test_a_hard_link_to_another_file_is_refused(in_shm: list[str]) -> None:
    other = os.path.join(SHM_DIR, f"not-kvtier-{uuid.uuid4().hex}")
    link = os.path.join(SHM_DIR, segment_like_name())
    in_shm.extend([other, link])
    with open(other, "wb") as f:
        f.write(CONTENT)
    os.link(other, link)
    attach_refused(hostile_reply(link), "2 links")
    with open(other, "rb") as f:
        assert f.read() == CONTENT


def test_a_segment_smaller_than_the_buffer_described_is_refused(in_shm: list[str]) -> None:
    short = os.path.join(SHM_DIR, segment_like_name())
    in_shm.append(short)
    with open(short, "wb") as f:
        f.write(CONTENT)
    attach_refused(hostile_reply(short, pages=4), "less than the 16384-byte buffer")


# A receiver and its sender in a child process: the old sender died there of SIGBUS.
SHRINK = """
import os, socket, sys, msgspec, torch
from kvtier.errors import TransferError
from kvtier.pd.channels.shm import ShmReceiver, ShmSender
from kvtier.pd.protocol import HelloReply
PAGE = int(sys.argv[1])
receiver = ShmReceiver()
receiver.make_pool(4, PAGE)
path = receiver.shm_path
fields = {"type": "HelloReply", "num_pages": 4, "page_bytes": PAGE,
          "shm_path": path, "shm_segment": os.path.basename(path)}
reply = msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=HelloReply)
sender = ShmSender()
sender.attach(reply)
a, b = socket.socketpair()
data = torch.full((PAGE,), 7, dtype=torch.uint8)
assert sender.send_chunk(a, "r", 0, 0, data) == PAGE
os.truncate(path, PAGE)  # the receiver shrinks its segment under the mapping
try:
    sender.send_chunk(a, "r", 1, 3, data)
except TransferError as exc:
    print("refused:", exc, flush=True)
sender.close()
receiver.close()
"""


def test_a_segment_shrunk_under_the_sender_is_refused_not_a_crash() -> None:
    child = subprocess.run(
        [sys.executable, "-c", SHRINK, str(PAGE)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "refused:" in child.stdout and "shrank to 4096 bytes" in child.stdout, child.stdout


def test_chunks_still_land_in_the_receivers_pages() -> None:
    receiver = ShmReceiver()
    pool = receiver.make_pool(4, PAGE)
    sender = ShmSender()
    a, b = socket.socketpair()
    try:
        sender.attach(HelloReply(4, PAGE, **receiver.greet(Hello("f", PAGE, 1, "shm"))))
        data = torch.arange(PAGE, dtype=torch.int32).to(torch.uint8)
        sender.send_chunk(a, "r", 0, 2, data)
        assert torch.equal(pool.page_bytes_view(2, PAGE), data)
    finally:
        sender.close()
        receiver.close()
        a.close()
        b.close()
