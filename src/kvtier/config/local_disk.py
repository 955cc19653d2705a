"""``local_disk``'s value as a filesystem path (the disk tier's and ``kvtier check-config``'s
reading, one function so the two never disagree)."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from kvtier.errors import ConfigError


def parse_local_disk(raw: str) -> str:
    """``local_disk`` as a filesystem path: a plain path or a ``file://`` URL.

    ``file:///abs/dir`` and ``file://localhost/abs/dir`` are absolute. ``file://rel/dir`` is
    the relative path ``rel/dir`` (from the working directory), as LMCache reads it (it strips
    ``file://``; its own examples say ``file://local/disk_test/local_disk/``), not a host."""
    if "://" not in raw:
        return os.path.abspath(os.path.expanduser(raw))
    url = urlparse(raw)
    if url.scheme != "file" or not (url.netloc or url.path.strip("/")):
        raise ConfigError(
            "local_disk", raw, "a directory path or a file:// URL (file:///abs/dir, file://rel/dir)"
        )
    if url.netloc in ("", "localhost"):
        return os.path.abspath(unquote(url.path))
    return os.path.abspath(unquote(url.netloc + url.path))
