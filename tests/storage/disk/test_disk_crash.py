"""Faults a disk tier must survive: a writer killed mid-store, and a full disk.

The data of sequence ``i`` is derived from ``i`` alone (``make_tokens(32, i)``,
``make_kv(32, i)``), so the checking process knows every byte the killed writer stored.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvtier import Engine
from kvtier.storage.disk.tier import DiskTier
from tests.conftest import SMALL_CHUNK, make_kv, make_tokens
from tests.storage.disk.disk_helpers import chunk_files, temp_files

Factory = Callable[..., Engine]
SEQ_TOKENS = 2 * SMALL_CHUNK
REPO = Path(__file__).resolve().parents[3]

WRITER = textwrap.dedent(
    """
    import sys
    from kvtier import Engine
    from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config

    cfg = small_config(local_disk=sys.argv[1], max_local_disk_size="64MiB")
    engine = Engine(cfg, SMALL_LAYOUT, model_name="test-model").open()
    i = 0
    while True:
        n = engine.store(make_tokens(32, i), make_kv(32, i))  # 0..2 (a full buffer drops)
        print("stored", i, n, flush=True)
        if i % 5 == 4:
            engine.flush(30)
            print("flushed", i, 0, flush=True)
        i += 1
    """
)


def _read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"writer exited early with {proc.wait()}")
            return line
    raise AssertionError("writer made no progress in time")


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}/src:{REPO}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "cache")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_sigkill_mid_store_loop_serves_only_exact_bytes(
    writer: subprocess.Popen[str], tmp_path: Path, engine_factory: Factory
) -> None:
    deadline = time.monotonic() + 60
    last_stored = last_flushed = -1
    fully_stored: set[int] = set()  # store() took both chunks (none dropped for lack of pages)
    while last_flushed < 24:  # let it run a while, with writes in flight
        kind, index, count = _read_line(writer, deadline).split()
        if kind == "stored":
            last_stored = int(index)
            if count == "2":
                fully_stored.add(last_stored)
        else:
            last_flushed = int(index)
    # Kill right after a store returned: its chunks are queued or being written right now.
    while True:
        kind, index, _ = _read_line(writer, deadline).split()
        if kind == "stored" and int(index) % 5 != 4:
            last_stored = int(index)
            break
    writer.send_signal(signal.SIGKILL)
    assert writer.wait(10) == -signal.SIGKILL

    engine = engine_factory(local_disk=str(tmp_path / "cache"), max_local_disk_size="64MiB")
    assert temp_files(tmp_path / "cache") == []
    served = 0
    for i in range(last_stored + 3):  # and a few it may have started after its last print
        rid = f"check-{i}"
        with engine.request(rid):
            hit = engine.lookup(make_tokens(SEQ_TOKENS, i), rid).tokens
            got = engine.retrieve(make_tokens(SEQ_TOKENS, i), rid)
        assert torch.equal(got, make_kv(SEQ_TOKENS, i)[:, :, : got.shape[2]]), f"sequence {i}"
        if i <= last_flushed and i in fully_stored:
            assert hit == got.shape[2] == SEQ_TOKENS, f"sequence {i} was flushed, so it is durable"
        served += got.shape[2] // SMALL_CHUNK
    assert len(fully_stored & set(range(last_flushed + 1))) >= 5
    assert served >= 2 * len(fully_stored & set(range(last_flushed + 1)))
    assert len(chunk_files(tmp_path / "cache")) >= served
    assert engine.check_invariants() == []


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: a real ENOSPC. Needs root (CAP_SYS_ADMIN) to mount."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(
            "cannot mount a tmpfs here; test_file_size_limit_fails_the_chunk covers the path"
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_enospc_fails_that_chunk_only_and_the_engine_keeps_going(
    tiny_fs: Path, engine_factory: Factory
) -> None:
    engine = engine_factory(
        local_disk=str(tiny_fs),
        max_local_disk_size="1MiB",
        use_only_staging_buffer=True,
        local_cpu=False,
    )
    for i in range(12):  # 24 chunk files of 8 KiB on a 64 KiB filesystem
        engine.store(make_tokens(SEQ_TOKENS, 100 + i), make_kv(SEQ_TOKENS, 100 + i))
        assert engine.flush(10)
    manager = engine._open_parts()[0]  # tests look inside on purpose
    assert manager is not None
    disk = manager.lower[0]
    assert isinstance(disk, DiskTier)
    assert disk.counters.no_space >= 1
    assert disk.counters.failed == disk.counters.no_space
    assert disk.counters.stored >= 2
    assert temp_files(tiny_fs) == []
    assert engine.check_invariants() == []
    assert engine.stats()["allocator"]["pages_free"] == engine.num_pages
    # Everything that was stored before the disk filled up is intact.
    intact = 0
    for i in range(12):
        rid = f"r{i}"
        with engine.request(rid):
            engine.lookup(make_tokens(SEQ_TOKENS, 100 + i), rid)
            got = engine.retrieve(make_tokens(SEQ_TOKENS, 100 + i), rid)
        assert torch.equal(got, make_kv(SEQ_TOKENS, 100 + i)[:, :, : got.shape[2]])
        intact += got.shape[2] // SMALL_CHUNK
    assert intact == disk.counters.stored == len(chunk_files(tiny_fs))
    assert disk.counters.corrupt == 0


LIMITED_WRITER = textwrap.dedent(
    """
    import resource, signal, sys
    from kvtier import Engine
    from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    # A record is 8 KiB: files above 6 KiB cannot be written (EFBIG), like a full disk.
    resource.setrlimit(resource.RLIMIT_FSIZE, (6 * 1024, resource.RLIM_INFINITY))
    cfg = small_config(local_disk=sys.argv[1], max_local_disk_size="1MiB")
    with Engine(cfg, SMALL_LAYOUT, model_name="test-model") as engine:
        engine.store(make_tokens(32, 7), make_kv(32, 7))
        assert engine.flush(10)
        disk = engine._open_parts()[0].lower[0]
        assert engine.check_invariants() == []
        with engine.request("r"):
            assert engine.lookup(make_tokens(32, 7), "r").tokens == 32  # still served from CPU
        print(disk.counters.failed, disk.counters.no_space, disk.counters.stored)
    """
)


def test_file_size_limit_fails_the_chunk(tmp_path: Path) -> None:
    """The same failure path as ENOSPC, reachable without root (RLIMIT_FSIZE -> EFBIG)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}/src:{REPO}"}
    done = subprocess.run(
        [sys.executable, "-c", LIMITED_WRITER, str(tmp_path / "cache")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2", "0"]
    assert temp_files(tmp_path / "cache") == [] and chunk_files(tmp_path / "cache") == []
