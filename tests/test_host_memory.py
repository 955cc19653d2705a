"""One reading of this host's memory: a cgroup limit lower than physical memory wins."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier import host_memory


def test_the_limit_is_physical_memory_without_a_cgroup_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_memory, "_CGROUP_MEMORY_MAX", str(tmp_path / "absent"))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert host_memory.machine_memory() == physical
    available = host_memory.available_memory()
    assert available is not None and 0 < available <= physical


def test_a_lower_cgroup_limit_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("1073741824\n")
    monkeypatch.setattr(host_memory, "_CGROUP_MEMORY_MAX", str(limit))
    assert host_memory.machine_memory() == 1 << 30
    available = host_memory.available_memory()
    assert available is not None and available <= 1 << 30
    limit.write_text("max\n")
    assert host_memory.machine_memory() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
