"""The disk tier's settings: ``local_disk``, ``max_local_disk_size`` and its
``extra_config`` keys, validated into :class:`DiskOptions`; and the directory check at open.

Keys (every bad value is a :class:`~kvtier.errors.ConfigError` naming the key)::

    local_disk                              a path or file:// URL
    max_local_disk_size                     capacity, at least one chunk file
    extra_config.disk_io_threads            1..64, default 4 (writer pool, and reader pool)
    extra_config.disk_max_inflight_bytes    bytes queued or being written; default 256 MiB
                                            (at least two chunk files), at least one file
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kvtier.config import Config
from kvtier.config import parsers as p
from kvtier.config.local_disk import parse_local_disk
from kvtier.config.sizes import format_size, parse_size
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.storage.disk.files import TMP_SUFFIX
from kvtier.storage.records import HEADER_SIZE

log = logging.getLogger(__name__)

DEFAULT_IO_THREADS = 4
DEFAULT_MAX_INFLIGHT_BYTES = 256 * 1024**2


@dataclass(frozen=True, slots=True)
class DiskOptions:
    path: str
    capacity_bytes: int
    io_threads: int = DEFAULT_IO_THREADS
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    timeout_s: float = 10.0  # blocking_timeout_secs: the longest a read (or close) waits
    cache_policy: str = "LRU"  # the index's eviction order (kvtier.storage.policy)


def options_from_config(config: Config, layout: KVLayout, chunk_size: int) -> DiskOptions:
    if not config.local_disk:
        raise ConfigError("local_disk", config.local_disk, "a directory path or file:// URL")
    extra = config.extra_config or {}
    record_bytes = HEADER_SIZE + layout.chunk_bytes(chunk_size)
    if config.max_local_disk_size < record_bytes:
        raise ConfigError(
            "max_local_disk_size",
            config.max_local_disk_size,
            f"at least one chunk file ({record_bytes} bytes = {format_size(record_bytes)}) "
            "for this model layout and chunk_size",
        )
    threads = p.integer(1, 64)(
        "extra_config.disk_io_threads", extra.get("disk_io_threads", DEFAULT_IO_THREADS)
    )
    inflight_key = "extra_config.disk_max_inflight_bytes"
    if "disk_max_inflight_bytes" in extra:
        inflight = parse_size(inflight_key, extra["disk_max_inflight_bytes"], 1)
        if inflight < record_bytes:
            raise ConfigError(
                inflight_key, inflight, f"at least one chunk file ({record_bytes} bytes)"
            )
    else:
        inflight = max(DEFAULT_MAX_INFLIGHT_BYTES, 2 * record_bytes)
    return DiskOptions(
        parse_local_disk(config.local_disk),
        config.max_local_disk_size,
        threads,
        inflight,
        config.blocking_timeout_secs,
        config.cache_policy,
    )


def open_directory(path: str, fp_hex: str) -> int:
    """An fd of the directory, created with its missing parents (as LMCache does), proven
    writable by creating and deleting a probe file. ConfigError naming the path otherwise."""
    try:
        if not os.path.exists(path):
            os.makedirs(path, 0o755)
            log.info("disk tier created directory %s", path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError("local_disk", path, f"a writable directory ({_why(path, exc)})") from None
    probe = f".{fp_hex}-probe.{os.getpid()}{TMP_SUFFIX}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=fd))
        os.unlink(probe, dir_fd=fd)
    except OSError as exc:
        os.close(fd)
        raise ConfigError("local_disk", path, f"a writable directory ({exc.strerror})") from None
    return fd


def _why(path: str, exc: OSError) -> str:
    """Why ``path`` could not be created or opened, naming the nearest part that exists:
    mkdir's ENOENT also comes from filesystems that refuse new entries (/proc, /sys), where
    "its parent does not exist" was false."""
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if existing == path:
        return f"{exc.strerror} opening it"
    what = "a directory" if os.path.isdir(existing) else "not a directory"
    return f"{exc.strerror} creating it; {existing} exists, {what}"
