"""The shape of the KV a model produces, and the byte arithmetic that follows from it.

One chunk holds the per-token cache of every layer for ``chunk_size`` tokens, contiguous::

    chunk tensor: [planes, num_layers, tokens, num_kv_heads * head_dim]
                   K/V     layer       token   hidden (all KV heads)

    chunk_bytes = planes * num_layers * chunk_size * num_kv_heads * head_dim * dtype_bytes

``planes`` is 2 (K and V) for attention that caches keys and values, 1 for multi-head latent
attention (MLA: one latent vector per token, e.g. 512 + 64 rope dims, no separate K and V).
A partial chunk of ``t < chunk_size`` tokens uses the first
``planes * num_layers * t * hidden * dtype_bytes`` bytes of its page, laid out the same way.

A model is described as a list of KV-cache groups (:class:`KVGroup`, as vLLM's hybrid KV
cache manager sees it): each group has a kind and the layers in it, in model order::

    kind      one token (or position) costs                 a resume at token t needs
    full      K and V of every layer of the group           all tokens < t
    sliding   K and V (window w; sinks where the model has   tokens in [t - w, t)
              them: a per-head constant, in the weights)
    mla       one latent vector per layer, same on every     all tokens < t
              tensor-parallel rank
    state     a recurrent + conv state per position (Mamba,  the state at t only
              gated delta-net), taken at chunk boundaries

The layout's ``groups`` (every group's kind, layers and window) enter the model fingerprint,
so two models whose caches differ in any group never share a key. Groups of the chunk tensor
(``full``, ``sliding``, ``mla``) are stored with every token of the chunk. A ``state`` group
owns the last layers of the chunk tensor: they hold no tokens, but the raw bytes of every
state layer's state at the chunk's END (position ``(i + 1) * chunk_size``), packed::

    chunk tensor  [planes, attention layers | state layers, tokens, hidden]
                                               └─ bytes: state of model layer a, then b, ...
                                                  (zero padding to the end)

So a chunk (one record, one checksum) carries the attention KV of its tokens and the state
at its end: it is restored whole or not at all, never a partial state. A state group makes
partial chunks meaningless (the state of a partial chunk is not at a boundary): such a layout
is only stored in whole chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import torch

from kvtier.errors import InputError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in _DTYPES.items():
        if candidate == dtype:
            return name
    raise InputError(f"KV dtype {dtype} is not supported; use one of {', '.join(_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        allowed = ", ".join(_DTYPES)
        raise InputError(f"KV dtype {name!r} is not supported; use one of {allowed}") from None


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
    layer axis; for a ``state`` group, the chunk-tensor layers its packed state fills);
    ``window`` is the sliding window in tokens (0 for other kinds); ``detail`` describes a
    ``state`` group's content (e.g. ``"GDN_ATTN.3x35840"``: three layers of 35,840 bytes)."""

    kind: GroupKind
    layers: tuple[int, ...]
    window: int = 0
    detail: str = ""

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

    def describe(self) -> str:
        window = f"/w{self.window}" if self.window else ""
        detail = f"/{self.detail}" if self.detail else ""
        return f"{self.kind.value}{window}{detail}:{','.join(map(str, self.layers))}"


def parse_groups(text: str) -> tuple[KVGroup, ...]:
    """The groups of :meth:`KVLayout.describe_groups` (``"sliding/w128:0,2;full:1,3"``), as
    a client sends them to the kvtier server. Empty text: no groups (the default)."""
    if not text:
        return ()
    groups = []
    for part in text.split(";"):
        head, _, layers = part.partition(":")
        kind, *rest = head.split("/")
        window, detail = 0, ""
        for item in rest:
            if item.startswith("w") and item[1:].isdigit():
                window = int(item[1:])
            else:
                detail = item
        try:
            indexes = tuple(int(i) for i in layers.split(","))
        except ValueError:
            raise InputError(
                f"KV-cache group {part!r} has layers {layers!r}; expected comma-separated "
                "layer indexes, e.g. 'full:0,1,2'"
            ) from None
        groups.append(KVGroup(cast(GroupKind, kind), indexes, window, detail))
    return tuple(groups)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Per-rank KV geometry of a model: what one token's KV looks like.

    ``planes`` is 2 (K and V) or 1 (an MLA latent). ``groups`` lists the model's KV-cache
    groups; empty means one group of every layer, ``full`` (planes 2) or ``mla`` (planes 1).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    planes: int = 2
    groups: tuple[KVGroup, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 16:
                raise InputError(
                    f"KVLayout.{name} must be an integer from 1 to 65536, got {value!r}"
                )
        if isinstance(self.dtype, str):  # allow KVLayout(..., dtype="bfloat16")
            object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        dtype_name(self.dtype)
        if self.planes not in (1, 2):
            raise InputError(
                f"KVLayout.planes must be 2 (K and V) or 1 (an MLA latent), got {self.planes!r}"
            )
        if not self.groups:
            kind = GroupKind.FULL if self.planes == 2 else GroupKind.MLA
            object.__setattr__(self, "groups", (KVGroup(kind, tuple(range(self.num_layers))),))
        self._check_groups()

    def _check_groups(self) -> None:
        cached = sorted(i for g in self.groups for i in g.layers)
        if cached != list(range(self.num_layers)):
            raise InputError(
                f"KVLayout.groups cover layers {cached} of the chunk tensor, but it has "
                f"{self.num_layers} layers: every layer 0..{self.num_layers - 1} must be in "
                "exactly one group"
            )
        attention = [i for g in self.groups if g.kind in CHUNK_KINDS for i in g.layers]
        if not attention or max(attention) >= len(attention):
            raise InputError(
                f"KVLayout.groups {self.describe_groups()}: the attention layers come first "
                "and state layers last in the chunk tensor"
            )
        mla = any(g.kind == GroupKind.MLA for g in self.groups)
        kv = any(g.kind in (GroupKind.FULL, GroupKind.SLIDING) for g in self.groups)
        if (mla and kv) or mla != (self.planes == 1):
            raise InputError(
                f"KVLayout.groups {self.describe_groups()} do not fit planes={self.planes}: "
                "mla groups need planes 1, full and sliding groups planes 2, never both"
            )

    @property
    def tp_shared(self) -> bool:
        """True when every tensor-parallel rank holds the same KV (MLA): one copy serves all
        ranks, so the fingerprint leaves the rank out."""
        return self.planes == 1

    def unsupported(self) -> list[KVGroup]:
        """Groups kvtier cannot store or restore: none since state groups are packed into
        the chunk (kept for callers that check)."""
        return [g for g in self.groups if g.kind not in CHUNK_KINDS and g.kind != GroupKind.STATE]

    @property
    def has_state(self) -> bool:
        """True when a chunk also carries a recurrent state (only whole chunks are valid)."""
        return any(g.kind == GroupKind.STATE for g in self.groups)

    def describe_groups(self) -> str:
        return ";".join(g.describe() for g in self.groups)

    def group_token_bytes(self) -> dict[str, int]:
        """Bytes kvtier stores per token for each group kind present (all its layers; for
        ``state``, its packed layers: the state at each chunk end, spread over the chunk)."""
        out: dict[str, int] = {}
        per_layer = self.planes * self.hidden * self.dtype_bytes
        for g in self.groups:
            out[g.kind.value] = out.get(g.kind.value, 0) + per_layer * len(g.layers)
        return out

    @property
    def hidden(self) -> int:
        """Width of one token's K (or V) across all KV heads."""
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def token_bytes(self) -> int:
        """Bytes of K and V (or the latent) of all layers for one token."""
        return self.planes * self.num_layers * self.hidden * self.dtype_bytes

    def chunk_bytes(self, chunk_size: int) -> int:
        return self.token_bytes() * chunk_size

    def kv_shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (self.planes, self.num_layers, tokens, self.hidden)

    def describe(self) -> str:
        what = "KV heads" if self.planes == 2 else "MLA latent"
        text = (
            f"{self.num_layers} layers x {self.num_kv_heads} {what} x {self.head_dim} "
            f"head dim, {dtype_name(self.dtype)}"
        )
        if len(self.groups) > 1 or self.groups[0].kind not in (GroupKind.FULL, GroupKind.MLA):
            text += f", groups {self.describe_groups()}"
        return text
