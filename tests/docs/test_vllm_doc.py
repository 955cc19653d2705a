"""docs/vllm.md says what a new user needs before the first vLLM start (the CPU block itself
runs in tests/integrations/vllm/test_vllm_doc_command.py)."""

from __future__ import annotations

from .doc_blocks import block_after, section


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
    assert "vllm serve MODEL" in cuda and "KVTierConnector" in cuda
    assert "allocated and touched" in " ".join(section("docs/vllm.md", "## Run").split())
