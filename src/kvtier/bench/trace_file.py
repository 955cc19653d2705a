"""A request trace of prefix-chained block ids (the Mooncake FAST'25 format), read for replay.

One JSON object a line; two fields are read, and a third where present::

    {"input_length": 6758, "hash_ids": [0, 1, 2, ..., 13], "tenant": "t0", ...}

``tenant`` (a string; the synthetic traces of :mod:`kvtier.bench.trace_synthetic` name one
per request) goes to ``Trace.tenants``; a trace without it has none.

``hash_ids`` holds one id per ``block_tokens``-token block of the prompt; the last block holds
what is left (``input_length - block_tokens * (n - 1)`` tokens, usually fewer). Equal ids must
mean equal prefixes up to that block, as kvtier's chained chunk keys do; a trace whose ids
name block *contents* only is chained with ``rechain``: a block's id becomes the pair
(chained id of its parent, its own id), numbered in order of first appearance.

A trace is named by a path or by the name of one shipped with kvtier (:data:`SHIPPED`, in
``kvtier/bench/traces/`` with its license and source), so the docs' bench commands run on an
installed kvtier, not only beside the repository's checkout of the data.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import InputError

TRACES_DIR = Path(__file__).parent / "traces"
# name -> file in TRACES_DIR. Mooncake's conversation trace, Apache-2.0 (traces/README.md).
SHIPPED: dict[str, str] = {"conversation": "conversation_trace.jsonl"}
DEFAULT = "conversation"


class TraceFormatError(InputError):
    """A trace line lacks ``hash_ids`` / ``input_length`` or they disagree, or is no JSON.

    An :class:`InputError`, so ``kvtier bench`` prints it as one ``kvtier: error:`` line."""


def add_path_argument(parser: argparse.ArgumentParser) -> None:
    """The positional trace argument every trace bench takes: a path or a shipped name."""
    parser.add_argument(
        "path",
        nargs="?",
        default=DEFAULT,
        help="JSONL trace (hash_ids and input_length per request), or the name of one "
        f"shipped with kvtier: {', '.join(SHIPPED)} (default: %(default)s)",
    )


def resolve(path: str | Path) -> Path:
    """The file ``path`` names: a shipped trace by name, else the path itself, which must be
    a file (a missing one is an :class:`InputError` naming the shipped choices, not an
    ``OSError`` traceback)."""
    if isinstance(path, str) and path in SHIPPED:
        return TRACES_DIR / SHIPPED[path]
    found = Path(path).expanduser()
    if not found.is_file():
        why = "is not a file" if found.exists() else "does not exist"
        raise InputError(
            f"trace {str(path)!r} {why}; give a JSONL trace file or the name of a trace "
            f"shipped with kvtier: {', '.join(SHIPPED)}"
        )
    return found


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order: each a list of block ids and the tokens of each block."""

    requests: list[list[int]]
    tokens: list[list[int]]
    block_tokens: int = 512  # a whole block's tokens
    # Each request's tenant (its cache_salt, say), or empty when the trace names none.
    tenants: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(sum(t) for t in self.tokens)

    @property
    def accesses(self) -> int:
        return sum(len(r) for r in self.requests)

    def unique_blocks(self) -> int:
        return len({b for r in self.requests for b in r})


def load(path: str | Path, *, block_tokens: int = 512, rechain: bool = False) -> Trace:
    """Read the trace ``path`` names (a file or a :data:`SHIPPED` name)."""
    path = resolve(path)
    requests: list[list[int]] = []
    tokens: list[list[int]] = []
    tenants: list[str] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:  # json.JSONDecodeError
                raise TraceFormatError(f"{path}:{number}: not a JSON object: {exc}") from exc
            try:
                ids = [int(i) for i in row["hash_ids"]]
                length = int(row["input_length"])
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}:{number}: needs hash_ids and input_length") from exc
            if not ids:
                continue
            last = length - block_tokens * (len(ids) - 1)
            if not 0 < last <= block_tokens:
                raise TraceFormatError(
                    f"{path}:{number}: input_length {length} does not fit {len(ids)} blocks "
                    f"of {block_tokens} tokens (--block-tokens)"
                )
            requests.append(ids)
            tokens.append([block_tokens] * (len(ids) - 1) + [last])
            tenants.append(str(row.get("tenant", "")))
    if rechain:
        requests = chain(requests)
    return Trace(requests, tokens, block_tokens, tenants if any(tenants) else [])


def chain(requests: list[list[int]]) -> list[list[int]]:
    """Ids that name a block's whole prefix: (parent's chained id, own id) numbered."""
    numbers: dict[tuple[int, int], int] = {}
    out = []
    for ids in requests:
        parent = -1
        chained = []
        for block in ids:
            parent = numbers.setdefault((parent, block), len(numbers))
            chained.append(parent)
        out.append(chained)
    return out
