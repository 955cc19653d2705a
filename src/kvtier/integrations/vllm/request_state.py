"""What the connector's scheduler side remembers of one request, from its first hook to its
end. Per request::

    tokens     the prompt (what kvtier hashes)
    salt       vLLM's per-request ``cache_salt``, or ExtraKeys with its LoRA adapter, images
               and prompt embeddings too (:mod:`.extra_keys`): it keys every chunk of the
               request (lookup, load, save, PD, events), as vLLM keys its own blocks
    uncached   why kvtier neither looks the request up nor saves it (something it cannot
               key: it fails closed), or None
    hit        the workers' :class:`~kvtier.hit.Hit`, asked once: ``tokens`` kvtier holds and has
               pinned for this request (the pin lives in the worker's lease until the
               request ends), and ``cpu_tokens``, the part of it in the CPU tier: a load
               reaching beyond it (disk, Redis) is asynchronous, the request waits and
               the batch keeps stepping
    local      tokens vLLM's own prefix cache supplied (whole blocks) when it last asked
    block_ids  the request's block table (first KV cache group)
    tables     with vLLM's hybrid KV cache manager and several KV-cache groups: every
               group's block table (``block_ids`` is ``tables[0]``); empty otherwise
    load       a load waiting for the next metadata: [local, local + accepted)
    saved      prompt tokens kvtier holds or is being given (whole chunks)
    checkpoint_saved  a sliding model's prompt checkpoint was saved, or needs no save
               (:mod:`.checkpoints`)
    transfer_id  PD: the prefiller's id for the request's transfer (:mod:`.handoff`)
    source     PD decoder (xPyD): the prefiller to pull from, until pulled
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.hit import Hit
from kvtier.integrations.vllm.handoff import Source
from kvtier.request_salt import RequestSalt


@dataclass
class RequestState:
    """One request as the scheduler side knows it (the fields: the module docstring)."""

    tokens: list[int]
    salt: RequestSalt | None = None
    uncached: str | None = None
    hit: Hit | None = None  # the workers' answer, asked once
    local: int = 0
    load_async: bool = False
    block_ids: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # every group's, when several
    load: tuple[int, int] | None = None
    saved: int = 0
    checkpoint_saved: bool = False
    transfer_id: str | None = None  # PD: named by the prefiller, passed on by the proxy
    source: Source | None = None  # PD decoder, xPyD: the prefiller to pull from, until pulled
    pull_since: float = 0.0


def set_tables(state: RequestState, tables: Any) -> None:
    """Keep every group's table when there are several (one group: ``block_ids`` is all)."""
    state.tables = [list(t) for t in tables] if tables and len(tables) > 1 else []
    if state.tables:
        state.tables[0] = state.block_ids


def copy_tables(state: RequestState) -> tuple[list[int], ...]:
    """Every group's table, copied (what a load or save spec carries)."""
    return tuple(t[:] for t in state.tables)
