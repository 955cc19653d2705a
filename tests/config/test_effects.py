"""Keys that load but do nothing, given the others (``kvtier check-config`` marks them)."""

from __future__ import annotations

from kvtier.config import Config
from kvtier.config.effects import keys_with_no_effect


def given(**overrides: object) -> dict[str, str]:
    return keys_with_no_effect(Config.load(env={}, overrides=overrides))


def test_a_default_is_never_reported() -> None:
    assert given() == {}


def test_pd_keys_without_enable_pd_do_nothing() -> None:
    found = given(pd_buffer_size="1GiB", pd_auth_token="x" * 20, transfer_channel="shm")
    assert set(found) == {"pd_buffer_size", "pd_auth_token", "transfer_channel"}
    assert given(enable_pd=True, pd_role="receiver", pd_buffer_size="1GiB") == {}


def test_tier_settings_without_their_tier_do_nothing() -> None:
    found = given(max_local_disk_size=5, disk_codec="lossless", remote_codec="fp8")
    assert set(found) == {"max_local_disk_size", "disk_codec", "remote_codec"}
    assert "use_only_staging_buffer" in given(use_only_staging_buffer=True)  # local_cpu true
    assert "cpu_codec_staging" in given(cpu_codec_staging="64MiB")  # identity codec


def test_sender_and_receiver_keys_on_the_other_side_do_nothing() -> None:
    receiver = given(enable_pd=True, pd_role="receiver", pd_buffer_size="1GiB", pd_serve_port=7000)
    assert set(receiver) == {"pd_serve_port"}
    pusher = given(
        enable_pd=True,
        pd_role="sender",
        pd_peer_alloc_port=7400,
        pd_buffer_device="cpu",
        pd_serve_host="0.0.0.0",
    )
    assert set(pusher) == {"pd_buffer_device", "pd_serve_host"}


def test_admin_keys_without_the_admin_api_do_nothing() -> None:
    assert set(given(admin_token="t", internal_api_server_port_start=7000)) == {
        "admin_token",
        "internal_api_server_port_start",
    }
    assert given(internal_api_server_enabled=True, admin_token="t") == {}
