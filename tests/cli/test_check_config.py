"""``kvtier check-config`` finds what would fail at vLLM's start, all of it in one run, probes
the real things a config names (Redis, the disk directory), marks keys that do nothing, and
answers without importing torch (issue 50, item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.cli.check_config import DTYPE_BYTES
from kvtier.layout import KVLayout
from tests.redis_servers import RedisServer, free_port

TINY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32"]


def check(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "check-config", str(path), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_every_problem_is_listed_in_one_run(tmp_path: Path) -> None:
    """A typo, a bad value, a directory nobody can create and a Redis that is not there:
    four problems, four lines, one run, exit 2 (LMCache's cuda decoder buffer is accepted as
    host memory, with a note on its row)."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "max_local_cpu_sise: 3\ncache_policy: LFU\n"
        "enable_pd: true\npd_role: receiver\npd_buffer_size: 1073741824\n"
        "pd_buffer_device: cuda\n"
        "local_disk: /proc/kvtier-check-config\nmax_local_disk_size: 1\n"
        f"remote_url: redis://127.0.0.1:{free_port()}/0\n"
    )
    result = check(path, *TINY)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvtier: error:")]
    assert len(errors) == 4, result.stderr
    for fragment in (
        "'max_local_cpu_sise'",
        "did you mean 'max_local_cpu_size'",
        "'cache_policy' has invalid value 'LFU'",
        "'local_disk' has invalid value '/proc/kvtier-check-config'",
        "a Redis that answers PING",
    ):
        assert fragment in result.stderr, fragment
    assert "4 problem(s)" in result.stderr and "Traceback" not in result.stderr
    assert "accepted as host memory" in result.stdout + result.stderr
    assert "(not shown)" not in result.stderr  # a typo is no value problem


def test_a_redis_that_answers_passes_and_a_wrong_password_is_named(tmp_path: Path) -> None:
    server = RedisServer().start()
    with server.client() as admin:  # from now on only the password gets in
        admin.config_set("requirepass", "the-right-password")
    try:
        path = tmp_path / "c.yaml"
        host_port = f"127.0.0.1:{server.port}"
        path.write_text(f"remote_url: redis://:the-right-password@{host_port}/0\n")
        good = check(path, *TINY, "--json")
        assert good.returncode == 0, good.stderr
        data = json.loads(good.stdout)
        assert any(line.startswith("remote_url: PING") for line in data["checked"])
        assert data["errors"] == [] and "the-right-password" not in good.stdout
        path.write_text(f"remote_url: redis://:a-wrong-password@{host_port}/0\n")
        bad = check(path, *TINY)
        assert bad.returncode == 2
        assert "remote_url" in bad.stderr and "PING" in bad.stderr
        assert "a-wrong-password" not in bad.stderr  # the URL is shown masked
    finally:
        server.stop()
        server.cleanup()


def test_the_disk_probe_writes_where_the_engine_will_and_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"local_disk: {tmp_path}/new/deeper\nmax_local_disk_size: 1\n")
    result = check(path, *TINY, "--json")
    assert result.returncode == 0, result.stderr
    checked = json.loads(result.stdout)["checked"]
    assert f"local_disk: write+fsync+delete in {tmp_path}/new/deeper: ok" in checked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # nothing created


def test_keys_that_load_but_do_nothing_are_marked(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("pd_buffer_size: 1GiB\nmax_local_disk_size: 5\nadmin_token: some-token\n")
    result = check(path, *TINY, "--json")
    assert result.returncode == 0, result.stderr
    no_effect = json.loads(result.stdout)["no_effect"]
    assert set(no_effect) == {"pd_buffer_size", "max_local_disk_size", "admin_token"}
    assert "enable_pd" in no_effect["pd_buffer_size"]
    text = check(path, *TINY)
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("pd_buffer_size"))
    assert "NO EFFECT: read only with enable_pd: true" in line


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_sizes_without_torch_are_the_layouts_own(tmp_path: Path, dtype: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\nmax_local_cpu_size: '100MiB'\n")
    args = ["--layers", "3", "--kv-heads", "2", "--head-dim", "16", "--dtype", dtype]
    result = check(path, *args, "--json")
    assert result.returncode == 0, result.stderr
    derived = json.loads(result.stdout)["derived"]
    layout = KVLayout(3, 2, 16, getattr(torch, dtype))
    assert derived["chunk_bytes"] == layout.chunk_bytes(64)
    assert derived["cpu_chunks"] == 100 * 1024**2 // layout.chunk_bytes(64)


def test_check_config_does_not_import_torch(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"local_disk: {tmp_path}/d\nmax_local_disk_size: 1\n")
    code = (
        "import sys; from kvtier.cli.main import main; "
        f"code = main(['check-config', {str(path)!r}]); "
        "print(code, 'torch' in sys.modules, file=sys.stderr)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.stderr.strip().splitlines()[-1] == "0 False", result.stderr


def test_lmcache_keys_kvtier_ignores_are_marked_too(tmp_path: Path) -> None:
    """LMCache's 1p1d prefiller: its proxy keys load (one WARNING) and do nothing in kvtier."""
    path = tmp_path / "prefiller.yaml"
    path.write_text(
        "enable_pd: True\npd_role: sender\npd_proxy_host: localhost\npd_proxy_port: 7500\n"
        "pd_buffer_size: 1073741824\ntransfer_channel: tcp\n"
    )
    result = check(path, *TINY, "--json")
    assert result.returncode == 0, result.stderr
    no_effect = json.loads(result.stdout)["no_effect"]
    assert {"pd_proxy_host", "pd_proxy_port"} <= set(no_effect)
    assert "kvtier notifies no proxy" in no_effect["pd_proxy_host"]
    text = check(path, *TINY).stdout
    assert any(ln.startswith("pd_proxy_port") and "NO EFFECT" in ln for ln in text.splitlines())


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("s3://kv-cache/team/../kv", "has a '..' segment"),
        ("s3://kv-cache/team//kv", "an empty segment"),
        ("s3://AKIAEXAMPLE:wJalrXUtnFEMI-not-a-real-secret@kv-cache/kv", "no credentials"),
        ("s3://user:wJalrXUtnFEMI-not-a-real-secret@minio.local:9000/kvb", "no credentials"),
    ],
)
def test_an_s3_url_the_tier_cannot_use_is_a_problem_with_no_secret_shown(
    tmp_path: Path, url: str, fragment: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"remote_url: '{url}'\n")
    result = check(path, *TINY)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert "not-a-real-secret" not in result.stdout + result.stderr


def test_help_says_json_and_a_json_file_is_read(tmp_path: Path) -> None:
    """vLLM's kv_connector_extra_config saved as a file is checked as it is (issue 58, 5)."""
    help_text = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "check-config", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "YAML or JSON file" in " ".join(help_text.split())
    path = tmp_path / "extra.json"
    path.write_text(json.dumps({"chunk_size": 64, "max_local_cpu_size": 1}))
    result = check(path, *TINY, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["chunk_size"] == 64


@pytest.mark.parametrize(
    ("given", "note"),
    [
        ("'5 GB'", "max_local_cpu_size 4.66 GiB (file {path}: '5GB' is decimal; a bare 5 would"),
        ("5", "max_local_cpu_size 5.00 GiB (file {path}: 5 as a bare number or '5GiB'; '5GB'"),
    ],
)
def test_a_size_lmcache_reads_as_gb_gets_one_note_line(
    tmp_path: Path, given: str, note: str
) -> None:
    """'5 GB' is decimal, 7 % under a bare 5: said where one checks a config, as the engine's
    start line says it (issue 58, item 6)."""
    path = tmp_path / "c.yaml"
    path.write_text(f"max_local_cpu_size: {given}\n")
    result = check(path, *TINY)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: " + note.format(path=path)), notes
    data = json.loads(check(path, *TINY, "--json").stdout)
    assert data["notes"] == [notes[0].removeprefix("note: ")]


def test_lm_url_is_one_problem(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("remote_url: lm://localhost:65000\n")
    result = check(path, *TINY)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvtier: error:")]
    assert len(errors) == 1 and "lm:// is LMCache's own cache server" in errors[0], errors
    assert "1 problem(s)" in result.stderr


def test_local_disk_without_a_size_is_one_problem_with_a_value_to_write(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"local_disk: {tmp_path}/disk\n")
    result = check(path, *TINY)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvtier: error:")]
    assert len(errors) == 1, errors
    assert "'max_local_disk_size' has invalid value 0" in errors[0]
    assert "e.g. max_local_disk_size: " in errors[0] and f"free on {tmp_path}" in errors[0]
    assert "1 problem(s)" in result.stderr
