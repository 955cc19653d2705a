"""Code blocks of README.md and docs/*.md, for the benchmarks and tests that run them as
written (docs/fleet.md's PD configs and router command, among others)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def block_after(doc: str, heading: str, lang: str | None = None) -> str:
    """The first fenced block after the line of ``doc`` (a path relative to the repository)
    that contains ``heading``; a ``lang`` block if given."""
    text = (ROOT / doc).read_text()
    at = text.find(heading)
    if at < 0:
        raise LookupError(f"{doc} has no {heading!r}")
    for match in FENCE.finditer(text, at):
        if lang is None or match.group(1) == lang:
            return match.group(2)
    raise LookupError(f"{doc}: no {lang or ''} block after {heading!r}")
