"""Chunk files on disk: names, the crash-safe write, the zero-copy read, the startup scan.

Names (one directory may hold several fingerprints: TP ranks, models, tenants)::

    <fp16hex>-<key32hex>.kvc              a complete record (header + payload)
    .<fp16hex>-<key32hex>.<n>.tmp         a write in progress; a leftover after a crash

A write goes to the temporary name, is fsynced, renamed over the final name, and the
directory is fsynced, so after a crash a final name holds either nothing or a complete
record (rename is atomic), and a temporary name is garbage to delete at the next open.
Every function takes the directory's file descriptor (``dir_fd``): names are resolved
relative to it, and a directory renamed away under us cannot redirect writes.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field

import torch

from kvtier.errors import CorruptRecord
from kvtier.fingerprint import KEY_BYTES, Fingerprint
from kvtier.keys import ChunkKey
from kvtier.storage.record_reads import stored_target
from kvtier.storage.records import HEADER_SIZE, RecordHeader, decode_header

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
_tmp_counter = itertools.count()
# Payload reads go in pieces this size: each is hashed right after it lands, still in the
# CPU's cache (L2 is 1 MiB per core here), and a piece is large enough that the syscall per
# piece costs under 1% of copying it.
READ_BLOCK = 1 << 20


def final_name(fp_hex: str, key: ChunkKey) -> str:
    return f"{fp_hex}-{key.hex()}{SUFFIX}"


def temp_name(fp_hex: str, key: ChunkKey) -> str:
    # pid and a counter: two writes of one key (two processes) never share a temp file.
    return f".{fp_hex}-{key.hex()}.{os.getpid()}-{next(_tmp_counter)}{TMP_SUFFIX}"


def write_record(
    dir_fd: int, key: ChunkKey, fp_hex: str, header: bytes, stored: memoryview
) -> None:
    """Write ``header + stored`` durably under the key's final name. Raises OSError (the
    temporary file is removed first); the final name is then untouched."""
    tmp = temp_name(fp_hex, key)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        try:
            _write_all(fd, [memoryview(header), stored])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final_name(fp_hex, key), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink_quietly(dir_fd, tmp)
        raise
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    except OSError:
        # Not durable, so not stored: take the file back rather than leave one the index
        # does not count.
        unlink_quietly(dir_fd, final_name(fp_hex, key))
        raise


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    pending = [b for b in buffers if b.nbytes]
    while pending:
        written = os.writev(fd, pending)
        if written == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        _consume(pending, written)


def read_record_into(
    dir_fd: int,
    key: ChunkKey,
    fingerprint: Fingerprint,
    fp_hex: str,
    out: torch.Tensor,
    on_piece: Callable[[memoryview], object] | None = None,
) -> tuple[RecordHeader, memoryview] | None:
    """Read the key's record: the header into a small buffer and check it, then the stored
    bytes in ``READ_BLOCK`` pieces, handing each to ``on_piece`` right after it lands, while
    it is still in the CPU cache (the tier hashes it there: one pass over memory instead of
    two). The stored bytes land where :func:`~kvtier.storage.record_reads.stored_target` says:
    straight into ``out`` (flat uint8, exactly the payload's size) for the identity codec, a
    scratch buffer for another. Returns the checked header and the stored bytes (the caller
    checks their checksum and decodes: :func:`~kvtier.storage.record_reads.finish_read`), None
    when the file is gone, or raises CorruptRecord (a bad header or file size stops before
    the stored bytes are read)."""
    try:
        fd = os.open(final_name(fp_hex, key), _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink planted under a chunk's name
            raise CorruptRecord("a symbolic link, not a chunk file") from None
        raise
    try:
        size = _check_regular(fd).st_size
        header_buf = bytearray(HEADER_SIZE)
        got = _read_all(fd, [memoryview(header_buf)], 0)
        header = decode_header(header_buf[:got], fingerprint, key)
        if header.payload_len != out.numel():
            raise CorruptRecord(
                f"record payload of {header.payload_len} bytes, expected {out.numel()}"
            )
        if size != header.record_len:  # before a scratch buffer of the stored length
            raise CorruptRecord(f"file of {size} bytes, its header says {header.record_len}")
        stored = stored_target(header, out)
        done = 0
        while done < stored.nbytes:
            piece = stored[done : done + READ_BLOCK]
            n = _read_all(fd, [piece], HEADER_SIZE + done)
            if on_piece is not None and n:
                on_piece(piece[:n])
            done += n
            if n < piece.nbytes:
                break  # the file ends early: caught by the size check below
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != header.record_len or done != header.stored_len:
        raise CorruptRecord(f"file of {size} bytes, its header says {header.record_len}")
    return header, stored


# O_NONBLOCK: opening a FIFO planted under a chunk's name returns at once instead of
# waiting for a writer (regular files ignore the flag); O_NOFOLLOW: a symlink is refused.
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW


def _check_regular(fd: int) -> os.stat_result:
    """A chunk is a regular file; anything else (FIFO, device, directory) is corrupt."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise CorruptRecord(f"not a regular file (mode {stat.filemode(info.st_mode)})")
    return info


def _read_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """preadv until the buffers are full or the file ends; returns bytes read."""
    total = 0
    pending = [b for b in buffers if b.nbytes]
    while pending:
        got = os.preadv(fd, pending, offset + total)
        if got == 0:
            break
        total += got
        _consume(pending, got)
    return total


def _consume(pending: list[memoryview], nbytes: int) -> None:
    """Drop the first ``nbytes`` from a list of buffers (a short writev/preadv moved them)."""
    while nbytes and pending:
        head = pending[0]
        if nbytes >= head.nbytes:
            nbytes -= head.nbytes
            pending.pop(0)
        else:
            pending[0] = head[nbytes:]
            nbytes = 0


def touch(dir_fd: int, fp_hex: str, key: ChunkKey) -> None:
    """Set the file's mtime to now: the startup scan orders the LRU index by mtime."""
    with contextlib.suppress(OSError):  # evicted or removed meanwhile: nothing to remember
        os.utime(final_name(fp_hex, key), dir_fd=dir_fd)


def temp_of_this_process(name: str) -> bool:
    """Whether ``name`` is a temporary name this process made (see :func:`temp_name`: a
    write of this process, maybe still running), not a leftover of another."""
    stem = name[: -len(TMP_SUFFIX)]  # .<fp>-<key>.<pid>-<n>
    return stem.rsplit(".", 1)[-1].split("-", 1)[0] == str(os.getpid())


def unlink_quietly(dir_fd: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False


@dataclass(frozen=True, slots=True)
class FoundRecord:
    key: ChunkKey
    header: RecordHeader
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class OtherFile:
    """A chunk file of another fingerprint, as listed (no header read): the directory's
    budget counts it (:mod:`kvtier.storage.disk.budget`)."""

    fp_hex: str
    name: str
    size: int
    mtime_ns: int


@dataclass
class ScanResult:
    records: list[FoundRecord]
    temp_removed: int = 0
    bad_removed: int = 0
    known_present: set[ChunkKey] = field(default_factory=set)
    others: list[OtherFile] = field(default_factory=list)  # other fingerprints' files


def scan(
    dir_fd: int,
    fingerprint: Fingerprint,
    fp_hex: str,
    known: Container[ChunkKey] = frozenset(),
) -> ScanResult:
    """Find this fingerprint's records by reading headers only, oldest first. Removes this
    fingerprint's temporary leftovers (of chunk writes and of index snapshots) and every
    record with a bad name, header or length. Files of other fingerprints and foreign files
    are left alone, and listed in ``others`` (name, size and mtime only). A file whose key
    is in ``known`` (a saved index's keys: :mod:`kvtier.storage.disk.snapshot`) is not
    opened: its key lands in ``known_present``."""
    result = ScanResult([])
    prefix, tmp_prefix = f"{fp_hex}-", f".{fp_hex}-"
    snapshot_tmp = f".{fp_hex}.index."
    for name in names(dir_fd):
        if name.startswith(tmp_prefix) and name.endswith(TMP_SUFFIX):
            result.temp_removed += unlink_quietly(dir_fd, name)
            continue
        if name.startswith(snapshot_tmp) and name.endswith(".part"):
            result.temp_removed += unlink_quietly(dir_fd, name)
            continue
        if not (name.startswith(prefix) and name.endswith(SUFFIX)):
            other = other_file(dir_fd, name, fp_hex)
            if other is not None:
                result.others.append(other)
            continue
        key = key_of(name, prefix)
        if key is not None and key in known:
            result.known_present.add(key)
            continue
        found = None if key is None else check_file(dir_fd, name, key, fingerprint)
        if found is None:
            result.bad_removed += unlink_quietly(dir_fd, name)
        else:
            result.records.append(found)
    result.records.sort(key=lambda r: r.mtime_ns)
    return result


def names(dir_fd: int) -> Iterator[str]:
    """The names of the regular files (and unknown types) in the directory, as listed."""
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                yield entry.name


_FP_HEX_LEN = 16
_FINAL_NAME_LEN = _FP_HEX_LEN + 1 + 2 * KEY_BYTES + len(SUFFIX)


def other_file(dir_fd: int, name: str, fp_hex: str) -> OtherFile | None:
    """``name`` as a chunk file of a fingerprint other than ``fp_hex`` (a regular file,
    stat'ed, its header unread), or None: not such a name, gone, or not a regular file."""
    if len(name) != _FINAL_NAME_LEN or name[_FP_HEX_LEN] != "-" or not name.endswith(SUFFIX):
        return None
    other = name[:_FP_HEX_LEN]
    if other == fp_hex or key_of(name, name[: _FP_HEX_LEN + 1]) is None:
        return None
    try:
        int(other, 16)
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (ValueError, OSError):
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return OtherFile(other, name, info.st_size, info.st_mtime_ns)


def key_of(name: str, prefix: str) -> ChunkKey | None:
    """The key in a final name (``prefix`` is ``"<fp16hex>-"``), or None for a bad one."""
    try:
        key = bytes.fromhex(name[len(prefix) : -len(SUFFIX)])
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


def check_file(
    dir_fd: int, name: str, key: ChunkKey, fingerprint: Fingerprint
) -> FoundRecord | None:
    """Read and check one file's header: its record, or None when it is gone or bad."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        info = _check_regular(fd)
        header = decode_header(os.pread(fd, HEADER_SIZE, 0), fingerprint, key)
    except CorruptRecord:
        return None
    finally:
        os.close(fd)
    if info.st_size != header.record_len:
        return None
    return FoundRecord(key, header, info.st_mtime_ns)
