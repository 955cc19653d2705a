"""The shape of the KV a model produces, and the byte arithmetic that follows from it.

One chunk holds the per-token cache of every layer for ``chunk_size`` tokens, contiguous::

    chunk tensor: [planes, num_layers, tokens, num_kv_heads * head_dim]
                   K/V     layer       token   hidden (all KV heads)

    chunk_bytes = planes * num_layers * chunk_size * num_kv_heads * head_dim * dtype_bytes

``planes`` is 2 (K and V) for attention that caches keys and values, 1 for multi-head latent
attention (MLA: one latent vector per token, e.g. 512 + 64 rope dims, no separate K and V).
A partial chunk of ``t < chunk_size`` tokens uses the first
``planes * num_layers * t * hidden * dtype_bytes`` bytes of its page, laid out the same way.

A model is described as a list of KV-cache groups (:class:`KVGroup`, in
:mod:`kvtier.kv_groups`, as vLLM's hybrid KV cache manager sees it): each group has a kind
and the layers in it, in model order::

    kind      one token (or position) costs                 a resume at token t needs
    full      K and V of every layer of the group           all tokens < t
    sliding   K and V (window w; sinks where the model has   tokens in [t - w, t)
              them: a per-head constant, in the weights)
    mla       one latent vector per layer, same on every     all tokens < t
              tensor-parallel rank
    state     a recurrent + conv state per position (Mamba,  the state at t only
              gated delta-net), taken at chunk boundaries

The layout's ``groups`` (every group's kind, layers, window and keep) enter the model
fingerprint, so two models whose caches differ in any group never share a key. A kind kvtier
does not model makes the layout one it cannot serve (:meth:`KVLayout.unsupported`).

What a chunk's page holds (its payload). ``full`` and ``mla`` groups store every token of the
chunk. A ``sliding`` group with ``keep = K`` stores only the last ``K`` tokens before the
chunk's end: what a request resuming at that boundary needs (the integration picks ``K``:
the window rounded to whole engine blocks, plus the block a resume one block early needs).
Without a trimmed group the page is the chunk tensor itself; with one, it is the groups'
parts one after another, each ``[planes, group layers, kept tokens, hidden]``::

    chunk of n tokens, groups sliding/w128/k144:0,2 ; full:1,3

    page:  | sliding: [2, 2 layers, min(n,144), hidden] | full: [2, 2 layers, n, hidden] |
             tokens n-min(n,144) .. n-1                    tokens 0 .. n-1

    payload_bytes(n) = sum over groups of planes * len(layers) * min(n, keep or n) * hidden
                       * dtype_bytes

:meth:`KVLayout.pack` and :meth:`KVLayout.unpack` move a chunk between the chunk tensor and its
page; ``unpack`` zeroes the tokens a trimmed group did not keep (never stale bytes).

A ``state`` group owns the last layers of the chunk tensor: they hold no tokens, but the raw
bytes of every state layer's state at the chunk's END (position ``(i + 1) * chunk_size``),
packed::

    chunk tensor  [planes, attention layers | state layers, tokens, hidden]
                                               └─ bytes: state of model layer a, then b, ...
                                                  (zero padding to the end)

So a chunk (one record, one checksum) carries the attention KV of its tokens and the state at
its end: it is restored whole or not at all, never a partial state. A state group makes
partial chunks meaningless (the state of a partial chunk is not at a boundary): such a layout
is only stored in whole chunks. In a page of groups its layers are one part, every token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.errors import InputError
from kvtier.kv_groups import CHUNK_KINDS as CHUNK_KINDS
from kvtier.kv_groups import GroupKind as GroupKind
from kvtier.kv_groups import KVGroup as KVGroup
from kvtier.kv_groups import parse_groups as parse_groups
from kvtier.kv_groups import sliding_keep as sliding_keep
from kvtier.kv_groups import state_layers_needed as state_layers_needed

Copy = Callable[[torch.Tensor, torch.Tensor], None]  # copy(dst, src)


def _copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A copy that has landed when it returns (host memory, or a device copy then waited)."""
    dst.copy_(src)


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

    def group_token_bytes(self, chunk_size: int | None = None) -> dict[str, float]:
        """Bytes kvtier stores per token for each group kind present (all its layers): per
        token of the model without ``chunk_size``, else averaged over a whole chunk (a
        trimmed sliding group stores ``keep`` of every ``chunk_size`` tokens)."""
        out: dict[str, float] = {}
        per_layer = self.planes * self.hidden * self.dtype_bytes
        for g in self.groups:
            if g.kind in CHUNK_KINDS or g.kind == GroupKind.STATE:
                share = g.kept(chunk_size) / chunk_size if chunk_size else 1
                value = per_layer * len(g.layers) * share
                out[g.kind.value] = out.get(g.kind.value, 0) + value
        return out

    @property
    def trims(self) -> bool:
        """Whether some group stores fewer tokens than the chunk has (a page of groups)."""
        return any(g.keep for g in self.groups)

    def _parts(self) -> list[tuple[KVGroup | None, tuple[int, ...]]]:
        """The page's parts in order: (group, layers); group None: every layer, every token."""
        if not self.trims:
            return [(None, tuple(range(self.num_layers)))]
        return [
            (g, g.layers) for g in self.groups if g.kind in CHUNK_KINDS or g.kind == GroupKind.STATE
        ]

    def payload_bytes(self, num_tokens: int) -> int:
        """Bytes of a chunk of ``num_tokens`` in its page (``num_tokens * token_bytes()``
        unless a group trims)."""
        per = self.planes * self.hidden * self.dtype_bytes
        return sum(
            per * len(layers) * (g.kept(num_tokens) if g else num_tokens)
            for g, layers in self._parts()
        )

    def pack(self, kv: torch.Tensor, dst: torch.Tensor, copy: Copy = _copy_now) -> None:
        """Copy one chunk ``kv`` (``[planes, layers, n, hidden]``, any strides and device)
        into ``dst`` (flat uint8 of at least :meth:`payload_bytes` of ``n``).

        ``copy(dst, src)`` makes each copy; across device and host memory it is a batch of
        :mod:`kvtier.memory.device` (the copy may land later: its fence says when)."""
        for view, layers, first in self._views(dst, kv.shape[2]):
            for at, (lo, hi) in _runs(layers):
                copy(view[:, at : at + hi - lo], kv[:, lo:hi, first:])

    def unpack(self, src: torch.Tensor, out: torch.Tensor, copy: Copy = _copy_now) -> None:
        """Copy one chunk's page ``src`` (flat uint8) into ``out`` (``[planes, layers, n,
        hidden]``); the tokens a trimmed group did not keep become zeros. ``copy``: as
        :meth:`pack`'s."""
        for view, layers, first in self._views(src, out.shape[2]):
            for at, (lo, hi) in _runs(layers):
                copy(out[:, lo:hi, first:], view[:, at : at + hi - lo])
                if first:
                    out[:, lo:hi, :first].zero_()

    def page_parts(self, num_tokens: int) -> list[tuple[str, int, int]]:
        """(group, byte offset, bytes) of each part of a chunk's page: one part of every
        layer unless a group trims (then one per group, named as :meth:`KVGroup.describe`)."""
        out = []
        offset = 0
        per = self.planes * self.hidden * self.dtype_bytes
        for g, layers in self._parts():
            nbytes = per * len(layers) * (g.kept(num_tokens) if g else num_tokens)
            out.append((g.describe() if g else self.describe_groups(), offset, nbytes))
            offset += nbytes
        return out

    def _views(
        self, page: torch.Tensor, num_tokens: int
    ) -> list[tuple[torch.Tensor, tuple[int, ...], int]]:
        """(typed view of the part, its layers, first token kept) for each part of a page."""
        out = []
        offset = 0
        for g, layers in self._parts():
            kept = g.kept(num_tokens) if g else num_tokens
            shape = (self.planes, len(layers), kept, self.hidden)
            nbytes = self.planes * len(layers) * kept * self.hidden * self.dtype_bytes
            view = page[offset : offset + nbytes].view(self.dtype).view(shape)
            out.append((view, layers, num_tokens - kept))
            offset += nbytes
        return out

    @property
    def hidden(self) -> int:
        """Width of one token's K (or V) across all KV heads."""
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def token_bytes(self) -> int:
        """Bytes of K and V (or the latent) of all layers for one token (the chunk tensor's;
        a trimmed group stores less: :meth:`payload_bytes`)."""
        return self.planes * self.num_layers * self.hidden * self.dtype_bytes

    def chunk_bytes(self, chunk_size: int) -> int:
        """Bytes of a whole chunk's page."""
        return self.payload_bytes(chunk_size)

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


def _runs(layers: tuple[int, ...]) -> list[tuple[int, tuple[int, int]]]:
    """Consecutive layer indexes as (position in ``layers``, (first, end)): one copy each."""
    runs: list[tuple[int, tuple[int, int]]] = []
    for at, layer in enumerate(layers):
        if runs and runs[-1][1][1] == layer:
            start, (lo, _) = runs[-1]
            runs[-1] = (start, (lo, layer + 1))
        else:
            runs.append((at, (layer, layer + 1)))
    return runs
