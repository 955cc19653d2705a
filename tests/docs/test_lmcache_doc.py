"""docs/lmcache.md's "Your vLLM command" block, its config lines run as written (the vLLM
start itself runs in tests/integrations/vllm/test_vllm_doc_command.py's CPU block): an
LMCache config checked by `kvtier check-config` before vLLM spends a minute starting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.redis_servers import free_port

from .doc_blocks import block_after

# LMCache's own disk example (a relative file:// directory that does not exist yet).
LMCACHE_DISK = (
    "chunk_size: 256\nlocal_cpu: False\nmax_local_cpu_size: 5.0\n"
    'local_disk: "file://local/disk_test/local_disk/"\nmax_local_disk_size: 5.0\n'
)


def config_lines() -> str:
    """The block's lines up to vLLM's start that need no model: the config and its check."""
    block = block_after("docs/lmcache.md", "## Your vLLM command", "bash")
    lines = [ln for ln in block.splitlines() if ln.startswith(("export LMCACHE_", "kvtier check"))]
    assert [ln.split()[0] for ln in lines] == ["export", "kvtier"]
    return "\n".join(lines)


def run_in(directory: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "LMCACHE_"))}
    # as a user whose environment has kvtier installed: its `kvtier` first on PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(
        ["bash", "-ec", config_lines()],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_check_passes_lmcaches_disk_example_and_creates_nothing(tmp_path: Path) -> None:
    (tmp_path / "lmcache.yaml").write_text(LMCACHE_DISK)
    result = run_in(tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"checked: local_disk: write+fsync+delete in {tmp_path}/local" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lmcache.yaml"]


def test_the_check_names_a_redis_that_does_not_answer(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    (tmp_path / "lmcache.yaml").write_text(f'chunk_size: 256\nremote_url: "{url}"\n')
    result = run_in(tmp_path)
    assert result.returncode == 2
    assert "'remote_url'" in result.stderr and "PING" in result.stderr
