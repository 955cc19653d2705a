"""Code blocks of README.md and docs/*.md, for tests that run them as written."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.harness.docs import FENCE as _FENCE
from benchmarks.harness.docs import block_after

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["ROOT", "block_after", "blocks", "section"]


def blocks(doc: str, lang: str | None = None) -> list[str]:
    """Fenced code blocks of ``doc`` (a path relative to the repository), in order."""
    text = (ROOT / doc).read_text()
    return [body for kind, body in _FENCE.findall(text) if lang is None or kind == lang]


def section(doc: str, heading: str) -> str:
    """The text of the section starting at the ``#`` heading line ``heading``, up to the next
    heading of the same or a higher level."""
    text = (ROOT / doc).read_text()
    at = text.find(heading + "\n")
    assert at >= 0, f"{doc} has no heading {heading!r}"
    level = len(heading) - len(heading.lstrip("#"))
    rest = text[at + len(heading) :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest
