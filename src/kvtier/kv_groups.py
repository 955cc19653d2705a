"""KV-cache groups: the kinds of per-token cache a model has, and which layers each covers.

A model is described (:class:`kvtier.layout.KVLayout`) as a list of groups, as vLLM's hybrid
KV cache manager sees it: each :class:`KVGroup` has a kind and the layers in it, in model
order. What each kind costs and needs, and how a page holds a chunk of groups, is the
layout's docstring; this module is the group description alone, with its text form (what a
client sends the kvtier server) and the sliding-window arithmetic of how much a group keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import cast

from kvtier.errors import InputError


class GroupKind(StrEnum):
    """What a KV-cache group keeps per token (or per position)."""

    FULL = "full"
    SLIDING = "sliding"
    MLA = "mla"
    STATE = "state"


# Kinds whose per-token cache lives in the chunk tensor (kvtier stores and serves them).
CHUNK_KINDS = (GroupKind.FULL, GroupKind.SLIDING, GroupKind.MLA)


def state_layers_needed(state_bytes: int, layer_bytes: int) -> int:
    """Layers of the chunk tensor (``layer_bytes`` each per chunk) that hold
    ``state_bytes`` of packed state."""
    return -(-state_bytes // layer_bytes)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group: layers that share a kind (and, for vLLM, one block table).

    ``layers`` are indexes into the model's cached layers in model order (the chunk tensor's
    layer axis); ``window`` is the sliding window in tokens (0 for other kinds); ``detail``
    names what kvtier does not model for a ``state`` group (e.g. ``"MambaSpec"``); ``keep``
    (sliding groups only) is how many tokens before each chunk's end the group stores, at
    least ``window`` (0: every token of the chunk). For a ``state`` group, ``layers`` are the
    chunk-tensor layers its packed state fills and ``detail`` describes its content (e.g.
    ``"GDN_ATTN.3x35840"``: three layers of 35,840 bytes)."""

    kind: GroupKind
    layers: tuple[int, ...]
    window: int = 0
    detail: str = ""
    keep: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            try:
                object.__setattr__(self, "kind", GroupKind(self.kind))
            except ValueError:
                kinds = ", ".join(k.value for k in GroupKind)
                raise InputError(
                    f"KVGroup.kind {self.kind!r} unknown; use one of {kinds}"
                ) from None
        if not self.layers or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers
        ):
            raise InputError(
                f"KVGroup.layers must be a non-empty tuple of layer indexes, got {self.layers!r}"
            )
        if (self.kind == GroupKind.SLIDING) != (self.window > 0):
            raise InputError(
                f"KVGroup.window is {self.window!r} for a {self.kind.value} group; a sliding "
                "group needs a window above 0, other kinds 0"
            )
        if self.keep and (self.kind != GroupKind.SLIDING or self.keep < self.window):
            raise InputError(
                f"KVGroup.keep is {self.keep!r} for a {self.kind.value} group of window "
                f"{self.window}; only a sliding group trims, to at least its window"
            )

    def describe(self) -> str:
        window = f"/w{self.window}" if self.window else ""
        keep = f"/k{self.keep}" if self.keep else ""
        detail = f"/{self.detail}" if self.detail else ""
        return f"{self.kind.value}{window}{keep}{detail}:{','.join(map(str, self.layers))}"

    def kept(self, num_tokens: int) -> int:
        """Tokens of a chunk of ``num_tokens`` this group stores (its last ones)."""
        return min(num_tokens, self.keep) if self.keep else num_tokens


def parse_groups(text: str) -> tuple[KVGroup, ...]:
    """The groups of :meth:`KVLayout.describe_groups` (``"sliding/w128:0,2;full:1,3"``), as
    a client sends them to the kvtier server. Empty text: no groups (the default)."""
    if not text:
        return ()
    groups = []
    for part in text.split(";"):
        head, _, layers = part.partition(":")
        kind, *rest = head.split("/")
        window, keep, detail = 0, 0, ""
        for item in rest:
            if item.startswith("w") and item[1:].isdigit():
                window = int(item[1:])
            elif item.startswith("k") and item[1:].isdigit():
                keep = int(item[1:])
            else:
                detail = item
        try:
            indexes = tuple(int(i) for i in layers.split(","))
        except ValueError:
            raise InputError(
                f"KV-cache group {part!r} has layers {layers!r}; expected comma-separated "
                "layer indexes, e.g. 'full:0,1,2'"
            ) from None
        groups.append(KVGroup(cast(GroupKind, kind), indexes, window, detail, keep))
    return tuple(groups)


def sliding_keep(window: int, block_size: int) -> int:
    """Tokens before a chunk's end a sliding-window group of ``window`` stores (its ``keep``),
    in whole engine blocks of ``block_size``: what vLLM keeps (real blocks; the rest are its
    null block) for a request resuming at the chunk's end ``t`` or one block earlier (a hit
    never covers a prompt's last token, so a prompt of whole chunks resumes at ``t - block``)::

        vLLM skips tokens < p - window + 1 for a resume at p (get_num_skipped_tokens), in
        whole blocks: it keeps from block floor((p - window + 1) / block), i.e. the last
        ceil((window - 1) / block) blocks before p

        keep = block + ceil((window - 1) / block) * block      (window 128, block 16: 144)
    """
    return block_size + -(-(window - 1) // block_size) * block_size
