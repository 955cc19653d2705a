"""A request trace of prefix-chained block ids (the Mooncake FAST'25 format), read for replay.

One JSON object a line; only two fields are read::

    {"input_length": 6758, "hash_ids": [0, 1, 2, ..., 13], ...}

``hash_ids`` holds one id per ``block_tokens``-token block of the prompt; the last block holds
what is left (``input_length - block_tokens * (n - 1)`` tokens, usually fewer). Equal ids must
mean equal prefixes up to that block, as kvtier's chained chunk keys do; a trace whose ids
name block *contents* only is chained with ``rechain``: a block's id becomes the pair
(chained id of its parent, its own id), numbered in order of first appearance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class TraceFormatError(ValueError):
    """A trace line lacks ``hash_ids`` / ``input_length`` or they disagree."""


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order: each a list of block ids and the tokens of each block."""

    requests: list[list[int]]
    tokens: list[list[int]]
    block_tokens: int = 512  # a whole block's tokens

    @property
    def total_tokens(self) -> int:
        return sum(sum(t) for t in self.tokens)

    @property
    def accesses(self) -> int:
        return sum(len(r) for r in self.requests)

    def unique_blocks(self) -> int:
        return len({b for r in self.requests for b in r})


def load(path: str | Path, *, block_tokens: int = 512, rechain: bool = False) -> Trace:
    requests: list[list[int]] = []
    tokens: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
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
    if rechain:
        requests = chain(requests)
    return Trace(requests, tokens, block_tokens)


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
