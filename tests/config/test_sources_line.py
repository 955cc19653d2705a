"""Every load says where the config came from in one INFO line: the start-up line of a
server or a vLLM worker names the file and the KVTIER_* / LMCACHE_* variables it read
(issue 50, item 9)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.config import Config


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier config")]


def test_the_line_names_the_file_each_variable_family_and_the_overrides(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\n")
    env = {
        "KVTIER_MAX_LOCAL_CPU_SIZE": "1GiB",
        "LMCACHE_LOCAL_DISK": str(tmp_path / "d"),
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "1",
    }
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        Config.load(path, env=env, overrides={"cache_salt": "t"}, overrides_from="vLLM extra")
    assert lines(caplog) == [
        f"kvtier config: file {path} (chunk_size); env KVTIER_* (max_local_cpu_size); "
        "env LMCACHE_* (local_disk, max_local_disk_size); vLLM extra (cache_salt); "
        "the other keys at their defaults"
    ]


def test_with_nothing_given_it_says_no_file_was_read(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        Config.load(env={})
    (line,) = lines(caplog)
    assert "no file ($KVTIER_CONFIG_FILE and $LMCACHE_CONFIG_FILE unset)" in line
    assert "env KVTIER_* (none); env LMCACHE_* (none)" in line
