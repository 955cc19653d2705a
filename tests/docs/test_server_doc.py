"""docs/server.md's deployment recipes: the systemd unit passes `systemd-analyze verify`, the
DaemonSet keeps what the server needs (socket on a hostPath, one uid, a memory limit)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .doc_blocks import block_after, section


def test_systemd_unit_is_type_notify_with_socket_dir_and_memory_limit(tmp_path: Path) -> None:
    unit = block_after("docs/server.md", "### systemd", "ini")
    for line in (
        "Type=notify",
        "RuntimeDirectory=kvtier",
        "KillSignal=SIGTERM",
        "--socket /run/kvtier/kvtier.sock",
    ):
        assert line in unit, line
    assert any(line.startswith("MemoryMax=") for line in unit.splitlines())
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here; the unit's fields were checked")
    # The unit as written, but for the paths this machine has: kvtier's entry point and a
    # user that exists (systemd-analyze checks both).
    kvtier = Path(sys.executable).parent / "kvtier"
    assert kvtier.exists()
    text = unit.replace("/opt/kvtier/bin/kvtier", str(kvtier))
    text = text.replace("User=vllm", "User=root").replace("Group=vllm", "Group=root")
    path = tmp_path / "kvtier.service"
    path.write_text(text)
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if "kvtier.service" in line and "network-online.target" not in line
    ]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_daemonset_puts_the_socket_on_a_host_path_with_one_uid_and_a_memory_limit() -> None:
    text = section("docs/server.md", "### Kubernetes: a DaemonSet, the socket on a hostPath")
    assert 'ENTRYPOINT ["kvtier", "server"]' in text
    manifest = yaml.safe_load(block_after("docs/server.md", "Image (`Dockerfile`)", "yaml"))
    assert manifest["kind"] == "DaemonSet"
    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["--socket", "/run/kvtier/kvtier.sock"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["socket-dir"] == "/run/kvtier"
    assert volumes["socket-dir"]["hostPath"]["path"] == "/run/kvtier"
    assert pod["securityContext"]["runAsUser"] == 1000
    assert container["resources"]["limits"]["memory"]
    assert pod["terminationGracePeriodSeconds"] >= 30
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) <= {f"KVTIER_{k.upper()}" for k in _config_keys()}


def _config_keys() -> list[str]:
    from kvtier.config.schema import KEYS

    return [k.name for k in KEYS]
