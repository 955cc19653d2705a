"""Inside vLLM a bad kvtier config is one clear ERROR line before vLLM's long traceback
(issue 50, item 10)."""

from __future__ import annotations

import logging

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.sides import load_config


def test_a_bad_extra_config_value_is_one_error_line_naming_key_and_value(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVTIER_CONFIG_FILE", "LMCACHE_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError):
        load_config({"max_local_cpu_size": "12 parsecs", "async_lower_loads": True})
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("kvtier: vLLM cannot start with this config: ")
    assert "'max_local_cpu_size'" in lines[0] and "12 parsecs" in lines[0]


def test_every_problem_is_named_in_the_one_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start costs vLLM a minute: a typo and a bad value are named together, not one per
    start, and the line says how to check the rest without vLLM."""
    for name in ("KVTIER_CONFIG_FILE", "LMCACHE_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError):
        load_config({"max_local_cpu_sise": 3, "cache_policy": "LFU"})
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "2 problem(s)" in line and "\n" not in line
    assert "'max_local_cpu_sise'" in line and "'LFU'" in line
    assert "kvtier check-config" in line


def test_a_good_one_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert load_config({"chunk_size": 64}).chunk_size == 64
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
