"""PD config rules: checked when the config loads, naming the key."""

from __future__ import annotations

import logging

import pytest

from kvtier import Engine
from kvtier.config import Config
from kvtier.config.channels import nixl_installed
from kvtier.config.effects import HOST_RECEIVE_BUFFER
from kvtier.config.sizes import format_size
from kvtier.errors import ConfigError
from kvtier.pd.buffer import PDBuffer
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, small_config


def load(**overrides: object) -> Config:
    return Config.load(env={}, overrides=overrides)


def test_a_sender_names_its_decoder_or_has_a_send_buffer_decoders_pull_from() -> None:
    with pytest.raises(ConfigError) as info:
        load(enable_pd=True, pd_role="sender")
    assert info.value.key == "pd_buffer_size"
    assert "pd_peer_alloc_port" in str(info.value) and "pull" in str(info.value)
    assert load(enable_pd=True, pd_role="sender", pd_peer_alloc_port=5555).pd_peer_alloc_port
    pulled = load(enable_pd=True, pd_role="sender", pd_buffer_size="1MiB", pd_serve_port=7600)
    assert pulled.pd_serve_port == (7600,) and pulled.pd_serve_host == "127.0.0.1"


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


def test_the_pd_token_comes_from_the_environment_and_is_never_shown() -> None:
    token = "s3cret-pd-token-0123456789"
    cfg = Config.load(env={"KVTIER_PD_AUTH_TOKEN": token})
    assert cfg.pd_auth_token == token
    assert cfg.as_dict()["pd_auth_token"] == "***"
    assert token not in repr(cfg) and token not in str(cfg.as_dict())
    # kvtier's own key: an LMCache variable of that name is not read
    assert Config.load(env={"LMCACHE_PD_AUTH_TOKEN": token}).pd_auth_token is None


@pytest.mark.parametrize(
    ("token", "allowed"), [("", "unset the key"), ("short-token", "16 characters")]
)
def test_an_empty_or_short_pd_token_is_refused_without_echoing_it(token: str, allowed: str) -> None:
    """Empty is refused as every secret is (never read as "no auth"); short by its length."""
    with pytest.raises(ConfigError) as info:
        load(pd_auth_token=token)
    assert info.value.key == "pd_auth_token" and allowed in str(info.value)
    assert token == "" or token not in str(info.value)


def test_pd_limits_are_validated() -> None:
    cfg = load()
    assert (cfg.pd_reservation_ttl_sec, cfg.pd_max_connections) == (120.0, 64)
    assert (cfg.pd_idle_timeout_sec, cfg.pd_message_timeout_sec) == (300.0, 30.0)
    for key, bad in (
        ("pd_reservation_ttl_sec", 0),
        ("pd_max_connections", 0),
        ("pd_idle_timeout_sec", -1),
        ("pd_message_timeout_sec", "soon"),
    ):
        with pytest.raises(ConfigError) as info:
            load(**{key: bad})
        assert info.value.key == key


@pytest.mark.parametrize("device", ["cuda", "cpu", None])
def test_a_receiver_given_pd_buffer_device_cuda_opens_a_host_buffer_and_says_so_once(
    device: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache's PD configs say cuda: the receive buffer is host memory whatever the value,
    and only cuda (a placement the config asked for and does not get) is said, once."""
    config = small_config(
        enable_pd=True, pd_role="receiver", pd_buffer_size="16KiB", pd_buffer_device=device
    )
    with (
        caplog.at_level(logging.INFO, logger="kvtier"),
        Engine(config, SMALL_LAYOUT, model_name="m") as engine,
    ):
        tier = engine.tier("pd")
        assert isinstance(tier, PDBuffer) and tier.pool.buffer.device.type == "cpu"
    lines = [r.getMessage() for r in caplog.records if "pd_buffer_device" in r.getMessage()]
    if device != "cuda":
        assert lines == []
        return
    (line,) = lines
    pages = tier.num_pages
    assert line == (
        f"pd_buffer_device 'cuda' {HOST_RECEIVE_BUFFER}: {pages} pages, "
        f"{format_size(pages * SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK))}"
    )
    assert "host memory" in line and "host-to-device" in line
