"""The disk tier's error for a directory it cannot create names what exists (issue 50: it
said "its parent does not exist" of a parent that did)."""

from __future__ import annotations

import os

import pytest

from kvtier.errors import ConfigError
from kvtier.storage.disk.options import open_directory


def test_a_directory_that_cannot_be_created_names_the_part_that_exists() -> None:
    # /proc exists and refuses new entries with ENOENT, as a read-only or virtual mount can
    assert os.path.isdir("/proc")
    with pytest.raises(ConfigError) as info:
        open_directory("/proc/kvtier-disk-test/deeper", "00")
    text = str(info.value)
    assert "local_disk" in text and "/proc/kvtier-disk-test/deeper" in text
    assert "parent does not exist" not in text
    assert "/proc exists, a directory" in text
