"""docs/transformers.md's quick start runs as written (a temporary directory for /tmp/kv)."""

from __future__ import annotations

from pathlib import Path

from .doc_blocks import block_after


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    code = block_after("docs/transformers.md", "## Quick start", "python")
    assert "prompt_ids =" in code  # defined before use, not left to the reader
    code = code.replace('"/tmp/kv"', repr(str(tmp_path / "kv")))
    exec(compile(code, "docs/transformers.md", "exec"), {})  # its asserts check the hit
