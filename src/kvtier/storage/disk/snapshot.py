"""The disk tier's saved index: what a restart needs to skip reading every chunk file's header.

Rebuilding the index from the files' headers costs one open + read + stat per file (about
50 µs each here, so close to a minute for a million chunks), and even listing a million
names costs seconds. At a clean close the tier saves its index here; the next open builds
its index from this file alone and serves at once, then a background check
(:mod:`~kvtier.storage.disk.reconcile`) compares it with a listing of the directory::

    name listed and in the snapshot      trusted: its key, token count and size come from here
    name listed, not in the snapshot     header read and checked, as in a full scan
    in the snapshot, name not listed     dropped (the file is gone)

A snapshot can therefore never make the tier serve a wrong byte: a trusted entry is a key
whose file should exist under the name that the key and fingerprint determine, and every
read opens that file and checks its header, length and payload checksum anyway (a file that
is gone is a miss; a mismatch is a corrupt miss, the file removed). It is crash-safe in the
same sense: it is written to a temporary name, fsynced, renamed over ``.<fp16hex>.index``
and the directory fsynced, so a crash leaves the old snapshot or the new one, never a torn
one; one that fails its checksum, names another fingerprint or is unreadable is ignored (a
full scan) and replaced at the next close. A snapshot older than the files (a crash after it
was written) costs the background check a header read of only the files written since.

Format (little-endian)::

    offset  size
    0       8     magic b"KVTIDX\\x00\\x01"
    8       8     fingerprint id (8 bytes, Fingerprint.digest()[:8])
    16      8     entry count n
    24      28*n  entries, next victim first: key (16), num_tokens (u32), file bytes (u64)
    ..      16    xxh3-128 of everything before
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import xxhash

from kvtier.fingerprint import KEY_BYTES, Fingerprint
from kvtier.keys import ChunkKey

log = logging.getLogger(__name__)

MAGIC = b"KVTIDX\x00\x01"
_HEAD = struct.Struct("<8s8sQ")
_ENTRY = struct.Struct(f"<{KEY_BYTES}sIQ")
_DIGEST = 16
SUFFIX = ".index"


def snapshot_name(fp_hex: str) -> str:
    return f".{fp_hex}{SUFFIX}"


@dataclass(frozen=True, slots=True)
class SavedEntry:
    key: ChunkKey
    num_tokens: int
    file_bytes: int


def save(dir_fd: int, fingerprint: Fingerprint, entries: Iterable[SavedEntry]) -> int:
    """Write the snapshot durably (temporary name, fsync, rename, directory fsync). Returns
    the entry count; raises OSError (the temporary file is removed, the old snapshot stays)."""
    listed = list(entries)
    rows = ((e.key, e.num_tokens, e.file_bytes) for e in listed)
    return save_rows(dir_fd, fingerprint, rows, len(listed))


def save_rows(
    dir_fd: int, fingerprint: Fingerprint, rows: Iterable[tuple[ChunkKey, int, int]], count: int
) -> int:
    """:func:`save` from ``count`` plain ``(key, num_tokens, file_bytes)`` rows, packed as
    they come (no list of a million rows: building one woke the garbage collector over and
    over, 6 s of a 1M-entry close)."""
    fp_hex = fingerprint.hex()
    data = bytearray(_HEAD.size + count * _ENTRY.size)
    pack_into, size = _ENTRY.pack_into, _ENTRY.size
    offset = _HEAD.size
    written = 0
    for key, tokens, nbytes in rows:
        if written == count:
            raise ValueError(f"more than the {count} rows announced")
        pack_into(data, offset, key, tokens, nbytes)
        offset += size
        written += 1
    if written != count:
        raise ValueError(f"{written} rows, {count} announced")
    _HEAD.pack_into(data, 0, MAGIC, fingerprint.digest()[:8], count)
    data += xxhash.xxh3_128(bytes(data)).digest()
    replace_file(dir_fd, snapshot_name(fp_hex), data, 0o644)
    return count


def replace_file(dir_fd: int, name: str, data: bytes | bytearray, mode: int) -> None:
    """Write ``data`` as ``name`` in the directory atomically: a ``.part`` file written and
    fsynced, renamed over ``name``, then the directory fsynced (a crash leaves the old file
    or the new one, never half of one). Raises OSError; no ``.part`` file is left."""
    tmp = f"{name}.{os.getpid()}.part"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def load(dir_fd: int, fingerprint: Fingerprint) -> dict[ChunkKey, SavedEntry] | None:
    """The saved entries, next victim first, or None when there is no usable
    snapshot (missing, torn, another fingerprint's, unreadable: logged, never raised)."""
    rows = load_rows(dir_fd, fingerprint)
    if rows is None:
        return None
    return {key: SavedEntry(key, tokens, nbytes) for key, tokens, nbytes in rows}


def load_rows(dir_fd: int, fingerprint: Fingerprint) -> Iterator[tuple[ChunkKey, int, int]] | None:
    """:func:`load` as plain ``(key, num_tokens, file_bytes)`` rows, next victim first,
    unpacked as they are iterated: what an open of a million entries builds its index
    from (no object and no list per row)."""
    name = snapshot_name(fingerprint.hex())
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("disk index snapshot %s unreadable (%s): scanning the files", name, exc)
        return None
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size else b""
    except OSError as exc:
        log.warning("disk index snapshot %s unreadable (%s): scanning the files", name, exc)
        return None
    finally:
        os.close(fd)
    why = _check(data, fingerprint)
    if why is not None:
        log.warning("disk index snapshot %s ignored (%s): scanning the files", name, why)
        return None
    count = _HEAD.unpack_from(data)[2]
    return _ENTRY.iter_unpack(memoryview(data)[_HEAD.size : _HEAD.size + count * _ENTRY.size])


def _check(data: bytes, fingerprint: Fingerprint) -> str | None:
    if len(data) < _HEAD.size + _DIGEST:
        return f"{len(data)} bytes, shorter than a header"
    magic, fp_id, count = _HEAD.unpack_from(data)
    if magic != MAGIC:
        return f"magic {magic!r}, expected {MAGIC!r}"
    if fp_id != fingerprint.digest()[:8]:
        return "written for another fingerprint"
    if len(data) != _HEAD.size + count * _ENTRY.size + _DIGEST:
        return f"{len(data)} bytes for {count} entries"
    if xxhash.xxh3_128(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        return "checksum mismatch"
    return None
