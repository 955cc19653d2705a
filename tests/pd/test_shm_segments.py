"""The shm receive buffer cannot outlive its process: a segment left by a decoder that died
(SIGKILL here) is removed by the next receiver; a living one's never is. A sender opens only
a segment's name in its own directory (the hostile receivers are in test_shm_channel.py)."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.errors import TransferError
from kvtier.pd.channels.shm import SHM_DIR, ShmReceiver
from kvtier.pd.channels.shm_segments import (
    HIDDEN_GRACE_S,
    create_segment,
    open_segment,
    sweep_orphans,
)

PAGE = 4096

# A receiver in another process: prints its segment's path, then waits to be killed.
CHILD = """
import sys, time
from kvtier.pd.channels import shm, shm_segments
directory, pages = sys.argv[1], int(sys.argv[2])
if directory == shm.SHM_DIR:
    channel = shm.ShmReceiver()
    channel.make_pool(pages, 4096)
    path = channel.shm_path
else:
    path = shm_segments.create_segment(directory, pages * 4096).path
print(path, flush=True)
time.sleep(600)
"""


@contextmanager
def receiver_process(directory: str, pages: int) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, directory, str(pages)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        path = proc.stdout.readline().strip()
        assert path.startswith(directory), path
        yield proc, path
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_receivers_buffer_is_removed_by_the_next_receiver() -> None:
    with receiver_process(SHM_DIR, pages=16) as (proc, orphan):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.exists(orphan)  # nothing of the dead process's own ran: the file stayed
    channel = ShmReceiver()
    try:
        channel.make_pool(4, PAGE)
        assert not os.path.exists(orphan)
        assert os.path.exists(channel.shm_path)
    finally:
        channel.close()
    assert not os.path.exists(channel.shm_path)


def test_a_living_receivers_buffer_is_never_removed(tmp_path: Path) -> None:
    with receiver_process(str(tmp_path), pages=8) as (proc, alive):
        assert sweep_orphans(str(tmp_path)) == 0
        mine = create_segment(str(tmp_path), PAGE)
        assert os.path.exists(alive) and os.path.exists(mine.path)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Dead now: the next sweep frees exactly its bytes and leaves this process's own.
        assert sweep_orphans(str(tmp_path)) == 8 * PAGE
        assert not os.path.exists(alive) and os.path.exists(mine.path)
        mine.remove()
    assert os.listdir(tmp_path) == []


def test_a_segment_being_made_is_left_alone_until_it_is_stale(tmp_path: Path) -> None:
    """A hidden name is a segment between its create and its lock: only an old one is swept."""
    fresh, stale = tmp_path / ".kvtier-pd-1-fresh", tmp_path / ".kvtier-pd-2-stale"
    for path in (fresh, stale):
        path.write_bytes(b"x" * PAGE)
    old = time.time() - 2 * HIDDEN_GRACE_S
    os.utime(stale, (old, old))
    assert sweep_orphans(str(tmp_path)) == PAGE
    assert fresh.exists() and not stale.exists()


def test_only_this_channels_regular_files_are_considered(tmp_path: Path) -> None:
    other = tmp_path / "psm_not_ours"
    other.write_bytes(b"x")
    target = tmp_path / "target"
    target.write_bytes(b"y")
    (tmp_path / "kvtier-pd-link").symlink_to(target)
    (tmp_path / "kvtier-pd-dir").mkdir()
    assert sweep_orphans(str(tmp_path)) == 0
    assert sorted(os.listdir(tmp_path)) == [
        "kvtier-pd-dir",
        "kvtier-pd-link",
        "psm_not_ours",
        "target",
    ]


def test_a_missing_directory_sweeps_nothing(tmp_path: Path) -> None:
    assert sweep_orphans(str(tmp_path / "absent")) == 0


@pytest.mark.parametrize(
    "name",
    [
        "",
        "../kvtier-pd-1-0123456789ab",
        "/dev/shm/kvtier-pd-1-0123456789ab",
        "kvtier-pd-1-0123456789ab/../..",
        "kvtier-pd-1-0123456789ab/",
        ".kvtier-pd-1-0123456789ab",  # hidden: still being made
        "kvtier-pd-1-0123456789AB",
        "kvtier-pd-1-0123456789ab\n",
        "kvtier-pd--0123456789ab",
        "psm_0123",
    ],
)
def test_a_sender_opens_only_a_segment_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(TransferError, match="no shared-memory segment kvtier makes"):
        open_segment(str(tmp_path), name, PAGE)


def test_a_sender_maps_a_segment_by_its_name(tmp_path: Path) -> None:
    made = create_segment(str(tmp_path), 2 * PAGE)
    opened = open_segment(str(tmp_path), made.name, 2 * PAGE)
    try:
        opened.mapping[PAGE : PAGE + 3] = b"abc"
        assert made.mapping[PAGE : PAGE + 3] == b"abc"
        opened.check()
        os.truncate(made.path, PAGE)
        with pytest.raises(TransferError, match="shrank"):
            opened.check()
    finally:
        opened.close()
        opened.close()  # idempotent
        made.remove()


def _char_device(path: Path) -> None:
    """A character device of /dev/zero's numbers (mappable, size 0); root only."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("making a device file needs CAP_MKNOD")


@pytest.mark.parametrize("make", [os.mkfifo, _char_device], ids=["fifo", "char-device"])
def test_a_sender_maps_only_a_regular_file(tmp_path: Path, make: Callable[[Path], None]) -> None:
    """A receiver's own uid can put a pipe or a device under a segment's name. The size
    check refuses both too (their size is 0) but only by chance: it must be the file type
    that refuses them, named as such."""
    name = "kvtier-pd-1-0123456789ab"
    make(tmp_path / name)
    with pytest.raises(TransferError, match="is not a regular file") as caught:
        open_segment(str(tmp_path), name, 2 * PAGE)
    assert "bytes, less than" not in str(caught.value)


def test_a_segment_is_allocated_when_made_not_on_first_touch(tmp_path: Path) -> None:
    """Sparse, a /dev/shm too small for it would be a SIGBUS in whoever touched a page."""
    made = create_segment(str(tmp_path), 64 * PAGE)
    try:
        assert os.stat(made.path).st_blocks * 512 >= 64 * PAGE
    finally:
        made.remove()


def test_a_full_shm_directory_names_the_size_needed_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's /dev/shm is 64 MiB by default: a buffer that does not fit fails at
    creation with the sizes and the ways out, never a SIGBUS later."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TransferError) as caught:
        create_segment(str(tmp_path), 256 * 2**20)
    message = str(caught.value)
    assert f"needs {256 * 2**20}" in message and "bytes free of" in message
    assert "pd_buffer_size" in message and "transfer_channel: tcp" in message
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing left behind
