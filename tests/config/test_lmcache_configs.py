"""LMCache's example configs load unchanged, or are refused for a feature kvtier lacks, named.

The configs below are written here with the same keys and values as the examples in LMCache's
repository (CPU offload, disk, legacy ``local_device``, Redis, RESP, LMCache's server, PD
prefiller and decoder, CacheBlend, Redis ACL); nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import redis
import torch

from kvtier.cli.main import main
from kvtier.config import Config
from kvtier.config.channels import nixl_installed
from kvtier.config.effects import HOST_RECEIVE_BUFFER, keys_with_no_effect
from kvtier.config.lmcache import LMCACHE_KEYS, NO_CPU_TIER_STAGING
from kvtier.config.sizes import GIB, parse_size
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.pd.buffer import PDBuffer
from tests.redis_servers import RedisServer

CPU_OFFLOAD = "chunk_size: 256\nlocal_cpu: True\nmax_local_cpu_size: 5.0\n"
DISK = (
    "chunk_size: 256\nlocal_cpu: False\nmax_local_cpu_size: 5.0\n"
    'local_disk: "file://local/disk_test/local_disk/"\nmax_local_disk_size: 5.0\n'
)
LEGACY_DISK = (
    'chunk_size: 256\nlocal_device: "file://local/disk_test/"\nmax_local_cache_size: 5\n'
    'remote_url: null\nremote_serde: "naive"\npipelined_backend: False\n'
)
REDIS = (
    "chunk_size: 256\nlocal_cpu: True\nmax_local_cpu_size: 5\n"
    'remote_url: "redis://localhost:6379"\nremote_serde: "naive"\n'
)
RESP = 'chunk_size: 256\nremote_url: "resp://localhost:6379"\nremote_serde: "naive"\n'
LM_SERVER = 'chunk_size: 256\nlocal_cpu: False\nremote_url: "lm://localhost:65432"\n'
DECODER = (
    "local_cpu: False\nmax_local_cpu_size: 0\nmax_local_disk_size: 0\n"
    'enable_pd: True\npd_role: "receiver"\npd_peer_host: "localhost"\npd_peer_init_port: 7300\n'
    'pd_peer_alloc_port: 7400\npd_buffer_size: 1073741824\npd_buffer_device: "cpu"\n'
    'transfer_channel: "tcp"\nnixl_backends: ["UCX"]\n'
)
PREFILLER = (
    "local_cpu: False\nmax_local_cpu_size: 0\nmax_local_disk_size: 0\n"
    'enable_pd: True\npd_role: "sender"\npd_proxy_host: "localhost"\npd_proxy_port: 7500\n'
    'pd_buffer_size: 1073741824\npd_buffer_device: "cpu"\ntransfer_channel: "tcp"\n'
)
BLEND = (
    "chunk_size: 256\nlocal_cpu: True\nmax_local_cpu_size: 5\nenable_blending: True\n"
    'blend_special_str: " # # "\nuse_layerwise: True\n'
)
LAYERWISE = "chunk_size: 256\nlocal_cpu: True\nmax_local_cpu_size: 5\nuse_layerwise: True\n"
ASYNC_LOADING = (
    "chunk_size: 256\nlocal_cpu: True\nmax_local_cpu_size: 5\nenable_async_loading: True\n"
)
GPU_DEVICE = 'chunk_size: 256\nlocal_device: "cuda"\n'

# LMCache's 1p1d files byte for byte, pd_buffer_device "cuda" and comments included: the
# decoder and prefiller of examples/disagg_prefill/1p1d/configs/ in LMCache's repository
# (lmcache-decoder-config.yaml at 216b8e42, with the legacy nixl_* names;
# lmcache-prefiller-config.yaml at 02fe058c), and the pair its 1P1D guide
# (docs/source/.../1p1d.rst, "tested with LMCache 0.3.9") prints.
LMCACHE_1P1D_DECODER = (
    "local_cpu: False\nmax_local_cpu_size: 0\nmax_local_disk_size: 0\nremote_serde: NULL\n\n"
    'enable_nixl: True\nnixl_role: "receiver"\nnixl_receiver_host: "localhost"\n'
    "nixl_receiver_port: 55555\nnixl_buffer_size: 1073741824 # 1GB\n"
    'nixl_buffer_device: "cuda"\nnixl_enable_gc: True\nnixl_backends: [UCX]\n'
)
LMCACHE_1P1D_PREFILLER = (
    "local_cpu: False\nsave_unfull_chunk: true  # Don't discard partial chunks (< 256 tokens)\n"
    '\nenable_pd: True\ntransfer_channel: "nixl"\npd_role: "sender"\n'
    'pd_proxy_host: "localhost"\npd_proxy_port: 7500\npd_buffer_size: 1073741824 # 1GB\n'
    'pd_buffer_device: "cuda"\nnixl_backends: [UCX]'
)
GUIDE_1P1D_DECODER = """local_cpu: False

# PD-related configurations
enable_pd: True
transfer_channel: "nixl" # Using NIXL for transfer
pd_role: "receiver"        # Decoder acts as KV cache receiver
pd_peer_host: "localhost"  # Host where decoder is listening
pd_peer_init_port: 7300    # Port where initialization happens
pd_peer_alloc_port: 7400   # Port for memory allocation
pd_buffer_size: 1073741824  # 1GB buffer for KV cache transfer
pd_buffer_device: "cuda"   # Use GPU memory for buffer
nixl_backends:
  - "UCX"
"""
GUIDE_1P1D_PREFILLER = """local_cpu: False

# PD-related configurations
enable_pd: True
transfer_channel: "nixl"  # Using NIXL for transfer
pd_role: "sender"          # Prefiller acts as KV cache sender
pd_proxy_host: "localhost" # Host where proxy server is running
pd_proxy_port: 7500        # Port where proxy server is listening
pd_buffer_size: 1073741824  # 1GB buffer for KV cache transfer
pd_buffer_device: "cuda"   # Use GPU memory for buffer
nixl_backends:
  - "UCX"
"""
needs_nixl = pytest.mark.skipif(
    not nixl_installed(), reason="LMCache's files name transfer_channel nixl (kvtier[nixl])"
)


def load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return Config.load(env={"LMCACHE_CONFIG_FILE": str(path)})


def test_cpu_offload_and_disk_examples_load(tmp_path: Path) -> None:
    assert load(tmp_path, CPU_OFFLOAD).max_local_cpu_size == 5 * GIB
    disk = load(tmp_path, DISK)
    assert disk.local_disk == "file://local/disk_test/local_disk/" and not disk.local_cpu


def test_legacy_local_device_file_is_the_disk_tier(tmp_path: Path) -> None:
    config = load(tmp_path, LEGACY_DISK)
    assert config.local_disk == "file://local/disk_test/"
    assert config.max_local_disk_size == 5 * GIB
    assert config.origin["local_disk"].startswith("file ")


def test_resp_is_redis_and_redis_loads(tmp_path: Path) -> None:
    assert load(tmp_path, REDIS).remote_url == "redis://localhost:6379"
    assert load(tmp_path, RESP).remote_url == "redis://localhost:6379"


def test_lmcache_server_url_is_refused_naming_kvtier_server(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="remote_url") as info:
        load(tmp_path, LM_SERVER)
    assert "kvtier server" in str(info.value) and "redis://" in str(info.value)


def test_decoder_with_no_cpu_tier_loads(tmp_path: Path) -> None:
    config = load(tmp_path, DECODER)
    assert config.enable_pd and config.pd_role == "receiver"
    assert config.local_cpu is False
    assert config.max_local_cpu_size == parse_size("x", NO_CPU_TIER_STAGING, GIB)
    assert config.pd_peer_alloc_port == (7400,)


@needs_nixl
@pytest.mark.parametrize("text", [LMCACHE_1P1D_DECODER, GUIDE_1P1D_DECODER])
def test_lmcaches_1p1d_decoder_as_shipped_is_a_host_receive_buffer_said_once(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    """pd_buffer_device "cuda" unedited: the receive buffer is host memory, and the one
    WARNING at the buffer's construction says where the KV lands and what that costs."""
    assert 'device: "cuda"' in text
    config = load(tmp_path, text)
    assert config.enable_pd and config.pd_role == "receiver"
    assert config.pd_buffer_device == "cuda" and config.transfer_channel == "nixl"
    assert config.pd_buffer_size == 1073741824
    # check-config marks the row with the same words
    assert keys_with_no_effect(config)["pd_buffer_device"] == HOST_RECEIVE_BUFFER
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvtier.pd"):
        buffer = PDBuffer.from_config(config, layout, Fingerprint("m", layout, 256))
    assert buffer.num_pages == 1073741824 // layout.chunk_bytes(256)
    (line,) = [r.getMessage() for r in caplog.records if "pd_buffer_device" in r.getMessage()]
    assert "host memory" in line and "host-to-device" in line and "1.00 GiB" in line


@needs_nixl
@pytest.mark.parametrize("text", [LMCACHE_1P1D_PREFILLER, GUIDE_1P1D_PREFILLER])
def test_lmcaches_1p1d_prefiller_as_shipped_loads(tmp_path: Path, text: str) -> None:
    config = load(tmp_path, text)
    assert config.enable_pd and config.pd_role == "sender" and not config.local_cpu
    assert config.pd_buffer_device == "cuda" and config.pd_buffer_size == 1073741824
    assert "receive buffer" in keys_with_no_effect(config)["pd_buffer_device"]


def test_the_1p1d_prefiller_loads_as_a_prefiller_decoders_pull_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No decoder in it (LMCache's proxy names one per request): kvtier's prefiller then holds
    each request's chunks in a send buffer of pd_buffer_size and the decoder the router picks
    pulls them (docs/pd.md, xPyD). Its proxy keys are said to do nothing, once."""
    with caplog.at_level(logging.WARNING):
        config = load(tmp_path, PREFILLER)
    no_effect = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(no_effect) == 1
    assert "pd_proxy_host" in no_effect[0] and "pd_proxy_port" in no_effect[0]
    assert not hasattr(config, "pd_proxy_host")
    assert config.pd_role == "sender" and not config.local_cpu
    assert config.pd_peer_alloc_port is None and config.pd_buffer_size == 1073741824
    assert config.pd_serve_host == "127.0.0.1" and config.pd_serve_port is None
    # with a decoder named, the same file pushes to that one decoder (1P1D, as before)
    config = load(tmp_path, PREFILLER + 'pd_peer_host: "decoder"\npd_peer_alloc_port: 7400\n')
    assert config.pd_peer_alloc_port == (7400,)
    # LMCache's enable_xpyd is its alias of enable_pd
    xpyd = load(tmp_path, PREFILLER.replace("enable_pd: True", "enable_xpyd: True"))
    assert xpyd.enable_pd and xpyd.pd_role == "sender"
    # and without a buffer it is refused, naming both ways
    with pytest.raises(ConfigError, match="pd_buffer_size") as info:
        load(tmp_path, PREFILLER.replace("pd_buffer_size: 1073741824\n", ""))
    assert "pd_peer_alloc_port" in str(info.value)


def test_features_kvtier_lacks_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="enable_blending") as info:
        load(tmp_path, BLEND)
    assert "CacheBlend" in str(info.value)
    with pytest.raises(ConfigError, match="local_device"):
        load(tmp_path, GPU_DEVICE)
    with pytest.raises(ConfigError, match="remote_serde"):
        load(tmp_path, REDIS.replace('"naive"', '"cachegen"'))


def test_use_layerwise_is_kvtiers_own_layer_wise_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache's sgl_integration config: ``use_layerwise`` is a shared key meaning the same
    (loads and saves layer by layer), read without a warning; off by default."""
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        assert load(tmp_path, LAYERWISE).use_layerwise
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    off = load(tmp_path, LAYERWISE.replace("use_layerwise: True", "use_layerwise: False"))
    assert not off.use_layerwise
    assert not load(tmp_path, LAYERWISE.replace("use_layerwise: True\n", "")).use_layerwise


def test_ignored_keys_are_said_once_in_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        config = load(tmp_path, ASYNC_LOADING + "pin_timeout_sec: 30\n")
    assert config.chunk_size == 256
    lines = [r.getMessage() for r in caplog.records]
    assert sum("enable_async_loading" in line for line in lines) == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "enable_async_loading" in warning and "pin_timeout_sec" in warning


def test_legacy_nixl_keys_are_the_pd_keys(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "enable_nixl: True\nnixl_role: receiver\nnixl_receiver_host: 0.0.0.0\n"
        "nixl_receiver_port: 55555\nnixl_buffer_size: 1073741824\nnixl_buffer_device: cpu\n",
    )
    assert config.enable_pd and config.pd_role == "receiver"
    assert config.transfer_channel == "nixl" and config.pd_peer_alloc_port == (55555,)
    assert config.pd_buffer_size == 1073741824 and config.pd_peer_host == "0.0.0.0"


ACL_PASSWORD = "s3cret-acl-password"


def test_redis_acl_user_is_used_and_masked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = RedisServer().start()
    with server.client() as admin:  # from now on only the ACL user gets in
        admin.execute_command("ACL", "SETUSER", "kvtier", "on", f">{ACL_PASSWORD}", "~*", "+@all")
        admin.execute_command("ACL", "SETUSER", "default", "off")
    try:
        text = (
            f'chunk_size: 16\nmax_local_cpu_size: "8MiB"\nremote_url: "redis://127.0.0.1:'
            f'{server.port}"\nextra_config:\n  username: kvtier\n  password: "{ACL_PASSWORD}"\n'
        )
        config = load(tmp_path, text)
        assert ACL_PASSWORD not in repr(config) and ACL_PASSWORD not in json.dumps(config.as_dict())
        # used: the remote tier authenticates as the ACL user and writes
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        with Engine(config, layout, model_name="acl") as engine:
            engine.store(list(range(32)), torch.randn(2, 2, 32, 16))
            engine.flush()
            assert engine.stats()["tiers"]["redis"]["stored"] == 2
        with redis.Redis(
            port=server.port, username="kvtier", password=ACL_PASSWORD, socket_timeout=5
        ) as client:
            assert client.dbsize() == 2
        # masked: check-config prints neither the URL's password nor extra_config's
        assert main(["check-config", str(tmp_path / "lmcache.yaml"), "--json"]) == 0
        out = capsys.readouterr().out
        assert ACL_PASSWORD not in out and "kvtier" in out
    finally:
        server.stop()
        server.cleanup()


def test_the_key_table_in_docs_is_the_one_kvtier_applies() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "lmcache.md").read_text()
    for row in LMCACHE_KEYS:
        assert f"| `{row.name}` | {row.status} | {row.meaning} |" in doc, row.name


LEGACY_DISK_NO_SIZE = 'chunk_size: 256\nlocal_device: "file://kv_disk/"\n'


def test_lmcaches_disk_examples_run_as_written_relative_paths_and_missing_parents_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMCache's disk_local.yaml and disk_offline_inference example: a relative file:// path
    (LMCache strips 'file://'), a legacy local_device with no size (LMCache's 20 GB), and
    parents that do not exist yet (LMCache creates them)."""
    monkeypatch.chdir(tmp_path)
    legacy = load(tmp_path, LEGACY_DISK_NO_SIZE)
    assert legacy.max_local_disk_size == 20 * GIB
    assert legacy.origin["max_local_disk_size"].startswith("LMCache's default")
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    for text, directory in [
        (LEGACY_DISK_NO_SIZE, tmp_path / "kv_disk"),
        (DISK.replace("5.0\n", "0.01\n"), tmp_path / "local" / "disk_test" / "local_disk"),
    ]:
        config = load(tmp_path, text).with_overrides(max_local_cpu_size="1MiB")
        with Engine(config, layout, model_name="lmcache-example") as engine:
            assert engine.tier("disk") is not None
        assert directory.is_dir()


def test_check_config_refuses_what_the_engine_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = tmp_path / "lmcache.yaml"
    small = 'max_local_cpu_size: "1MiB"\nmax_local_disk_size: 1\n'
    path.write_text(f'local_disk: "file://{blocker}/disk/"\n{small}')
    tiny = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32"]
    assert main(["check-config", str(path), *tiny]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="local_disk"):
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        Engine(Config.load(path, env={}), layout, model_name="m").open()
    # and what check-config accepts, the engine opens (nothing is created by the check)
    path.write_text(f'local_disk: "file://{tmp_path}/new/deeper/"\n{small}')
    assert main(["check-config", str(path), *tiny]) == 0
    assert not (tmp_path / "new").exists()
