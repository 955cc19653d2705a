"""PD config rules: checked when the config loads, naming the key."""

from __future__ import annotations

import pytest

from kvtier.config import Config
from kvtier.config.channels import nixl_installed
from kvtier.errors import ConfigError


def load(**overrides: object) -> Config:
    return Config.load(env={}, overrides=overrides)


def test_a_sender_needs_the_decoders_port() -> None:
    with pytest.raises(ConfigError) as info:
        load(enable_pd=True, pd_role="sender")
    assert info.value.key == "pd_peer_alloc_port"
    assert load(enable_pd=True, pd_role="sender", pd_peer_alloc_port=5555).pd_peer_alloc_port


def test_a_receiver_needs_a_buffer_size() -> None:
    with pytest.raises(ConfigError) as info:
        load(enable_pd=True, pd_role="receiver")
    assert info.value.key == "pd_buffer_size"


def test_nixl_without_the_package_is_refused_at_load_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvtier.config.channels.nixl_installed", lambda: False)
    with pytest.raises(ConfigError, match="nixl-cu12") as info:
        load(enable_pd=True, pd_role="receiver", pd_buffer_size="1MiB", transfer_channel="nixl")
    assert info.value.key == "transfer_channel"


@pytest.mark.skipif(not nixl_installed(), reason="the optional nixl package is not installed")
def test_nixl_with_the_package_loads() -> None:
    cfg = load(enable_pd=True, pd_role="receiver", pd_buffer_size="1MiB", transfer_channel="nixl")
    assert cfg.transfer_channel == "nixl"
