"""vLLM's KV-cache groups as kvtier sees them: which kinds it serves, which turn it off.

vLLM describes a model's cache as ``KVCacheConfig.kv_cache_groups``: each group has layer
names and one spec. kvtier maps the spec classes of ``vllm/v1/kv_cache_interface.py``::

    MLAAttentionSpec                    mla       (a subclass of FullAttentionSpec: first)
    SlidingWindowSpec (not MLA)         sliding   (window = spec.sliding_window)
    FullAttentionSpec (incl. sinks)     full      (a merged spec with a sliding_window set
                                                   is vLLM keeping full KV for local layers:
                                                   full, the bytes are all there)
    anything else (MambaSpec, gated     unsupported: kvtier turns itself off for the model
    delta-net state, chunked-local,     with ONE warning naming the kind; vLLM serves on
    cross-attention, ...)               without it

Both the scheduler (which then answers "no hit" and saves nothing) and the worker (which then
opens no cache) decide from the same ``KVCacheConfig``, so they always agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvtier.layout import GroupKind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VllmGroup:
    kind: GroupKind | None  # None: a kind kvtier does not model
    window: int
    layer_names: tuple[str, ...]
    spec_name: str  # vLLM's spec class, for messages


@dataclass(frozen=True, slots=True)
class ModelGroups:
    groups: tuple[VllmGroup, ...]

    @property
    def unsupported(self) -> tuple[str, ...]:
        """Spec class names kvtier cannot serve (empty: kvtier serves the model)."""
        return tuple(dict.fromkeys(g.spec_name for g in self.groups if g.kind is None))

    @property
    def mla(self) -> bool:
        return any(g.kind == GroupKind.MLA for g in self.groups)

    def for_paged(self) -> list[tuple[GroupKind, int, tuple[str, ...]]]:
        """(kind, window, layer names) per group, for :meth:`PagedKV.from_vllm`."""
        out = []
        for g in self.groups:
            if g.kind is None:
                raise AssertionError("for_paged on a model kvtier does not serve")
            out.append((g.kind, g.window, g.layer_names))
        return out

    def warn_unsupported(self, model: str) -> None:
        log.warning(
            "kvtier: model %s has KV-cache layers of kind %s, which kvtier does not model "
            "(a recurrent state per position, not a per-token cache); kvtier is off for this "
            "model and vLLM serves it without an external cache",
            model,
            ", ".join(self.unsupported),
        )


def classify(kv_cache_config: Any) -> ModelGroups:
    """The groups of vLLM's ``KVCacheConfig`` (None: one full-attention group)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups: list[VllmGroup] = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        kind: GroupKind | None
        window = 0
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
        groups.append(VllmGroup(kind, window, tuple(group.layer_names), spec_name))
    return ModelGroups(tuple(groups))
