from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.cli.main import COMMANDS, build_parser, main
from kvtier.layout import KVLayout
from kvtier.storage.codecs import FP8
from kvtier.storage.cpu_coded import slot_shape


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if env is not None and "PYTHONPATH" in os.environ:  # the tree under test, not an install
        env = {**env, "PYTHONPATH": os.environ["PYTHONPATH"]}
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_every_registered_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    available = set(subparsers.choices)  # type: ignore[arg-type]
    assert {"check-config", "bench"} <= available <= set(COMMANDS)
    for name in available:
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0
        assert "usage: kvtier" in capsys.readouterr().out


def test_check_config_shows_values_sources_and_derived_sizes(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 256\nmax_local_cpu_size: '100MiB'\n")
    result = run_cli("check-config", str(path), "--json", env={"PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["config"]["max_local_cpu_size"] == 100 * 1024**2
    assert data["origin"]["chunk_size"] == f"file {path}"
    assert data["derived"]["chunk_bytes"] == 32 * 1024**2  # 8B-like layout, bf16
    assert data["derived"]["cpu_chunks"] == 3  # 100 MiB rounded down to whole 32 MiB chunks
    assert data["derived"]["cpu_bytes_used"] == 96 * 1024**2


def test_check_config_counts_a_coded_cpu_tier_in_its_coded_chunks(tmp_path: Path) -> None:
    """With a cpu_codec the same bytes hold more chunks: a staging page plus slots the size
    of one coded chunk (fp8 on bf16 KV: about half a chunk each), not whole decoded pages."""
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 256\nmax_local_cpu_size: '100MiB'\ncpu_codec: fp8\n")
    result = run_cli("check-config", str(path), "--json", env={"PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr
    derived = json.loads(result.stdout)["derived"]
    layout = KVLayout(32, 8, 128, torch.bfloat16)  # check-config's default layout
    chunk = layout.chunk_bytes(256)
    slot, per_chunk = slot_shape(FP8, layout, 256)  # the coded store's own slot size
    assert derived["cpu_codec"] == "fp8" and derived["cpu_staging_chunks"] == 1
    assert per_chunk == 1 and slot >= FP8.stored_bytes(layout, 256)  # one chunk per slot
    assert derived["cpu_chunks"] == (100 * 1024**2 - chunk) // slot
    assert derived["cpu_chunks"] > 100 * 1024**2 // chunk  # more than identity's 3
    assert derived["cpu_bytes_used"] == chunk + derived["cpu_chunks"] * slot <= 100 * 1024**2


def test_check_config_bad_value_exits_2_with_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: -3\n")
    result = run_cli("check-config", str(path), env={"PATH": "/usr/bin"})
    assert result.returncode == 2
    assert "'chunk_size'" in result.stderr and "-3" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_table_lists_every_key() -> None:
    result = run_cli("check-config", "--table", env={"PATH": "/usr/bin"})
    assert result.returncode == 0
    for key in ("chunk_size", "max_local_cpu_size", "pd_buffer_size", "remote_url"):
        assert f"`{key}" in result.stdout


def test_version_prints_the_installed_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kvtier ") and len(result.stdout.split()) >= 2


def test_log_level_has_help_and_works_before_or_after_the_command(tmp_path: Path) -> None:
    top = run_cli("--help")
    assert "--log-level" in top.stdout and "WARNING" in top.stdout
    sub = run_cli("check-config", "--help")
    assert "--log-level" in sub.stdout
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 256\n")
    # an LMCache variable that is no config key is a WARNING (a misspelt key is an error)
    env = {"PATH": "/usr/bin", "LMCACHE_TRACK_USAGE": "false"}
    for args in (
        ("--log-level", "error", "check-config", str(path)),
        ("check-config", str(path), "--log-level", "ERROR"),
    ):
        quiet = run_cli(*args, env=env)
        assert quiet.returncode == 0, quiet.stderr
        assert "track_usage" not in quiet.stderr
    loud = run_cli("check-config", str(path), env=env)
    assert "track_usage" in loud.stderr
    bad = run_cli("check-config", "--log-level", "chatty")
    assert bad.returncode == 2 and "CHATTY" in bad.stderr and "WARNING" in bad.stderr


def test_server_help_names_both_config_file_variables() -> None:
    result = run_cli("server", "--help")
    flat = " ".join(result.stdout.split())
    assert "KVTIER_CONFIG_FILE" in flat and "LMCACHE_CONFIG_FILE" in flat


def test_output_is_line_buffered_when_redirected() -> None:
    """`kvtier demo > log` shows each line as it is printed, not in 8 KiB blocks at exit."""
    code = (
        "import sys; from kvtier.cli.main import main; main(['check-config', '--table']); "
        "print(sys.stdout.line_buffering, file=sys.stderr)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "True"
