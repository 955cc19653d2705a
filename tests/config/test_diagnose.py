"""``Config.diagnose``: every problem of a config at once, where ``Config.load`` raises the
first (``kvtier check-config`` lists them all in one run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.errors import ConfigError


def test_every_bad_value_rule_and_refusal_is_collected(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "chunk_size: -3\ncache_policy: LFU\nmax_local_cpu_sise: 2\nenable_blending: true\n"
        "local_disk: /tmp/somewhere\nmax_local_disk_size: 0\nenable_pd: true\n"
    )
    config, errors = Config.diagnose(path, env={})
    keys = [error.args[0].split("'")[1] for error in errors]
    assert set(keys) == {
        "chunk_size",
        "cache_policy",
        "max_local_cpu_sise",
        "enable_blending",
        "max_local_disk_size",  # a rule between keys: local_disk needs a size
        "pd_role",  # another: enable_pd needs a role
    }
    # the config is there to show, each bad key at its default
    assert config is not None and config.chunk_size == 256 and config.cache_policy == "REUSE"
    with pytest.raises(ConfigError, match="enable_blending"):  # load stops at the first
        Config.load(path, env={})


def test_a_good_config_has_no_problem_and_equals_load(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\nmax_local_cpu_size: '1GiB'\n")
    config, errors = Config.diagnose(path, env={})
    assert errors == [] and config == Config.load(path, env={})


def test_an_unreadable_file_has_no_config_to_show(tmp_path: Path) -> None:
    config, errors = Config.diagnose(tmp_path / "missing.yaml", env={})
    assert config is None and len(errors) == 1 and "readable YAML file" in str(errors[0])


def test_collecting_does_not_leak_into_the_next_load(tmp_path: Path) -> None:
    Config.diagnose(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="pd_role"):
        Config.load(env={}, overrides={"enable_pd": True})


def test_both_p2p_rules_are_collected_with_the_rest(tmp_path: Path) -> None:
    # The P2P rules once raised at the first broken one, hiding the others from check-config.
    path = tmp_path / "c.yaml"
    path.write_text("p2p_peers: ['127.0.0.1:7000']\np2p_auth_token: short\nenable_pd: true\n")
    _, errors = Config.diagnose(path, env={})
    keys = {error.args[0].split("'")[1] for error in errors}
    assert {"p2p_auth_token", "p2p_listen", "pd_role"} <= keys
    assert "short" not in " ".join(str(e) for e in errors)  # a token is never echoed
