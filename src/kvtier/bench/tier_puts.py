"""A bench's store through a tier's own write path: every chunk put, every completion awaited."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvtier.bench.checks import require
from kvtier.keys import ChunkKey
from kvtier.storage.base import PutJob, PutOutcome, PutResult, Tier
from kvtier.storage.tenants import NO_SALT


def put_all(
    tier: Tier,
    keys: Sequence[ChunkKey],
    pages: torch.Tensor,
    num_tokens: int,
    tenant: str = NO_SALT,
) -> None:
    """Put ``pages[i]`` under ``keys[i]`` through ``tier.put`` and wait for every completion;
    a put that did not store fails the bench (a figure over bytes never written is no figure)."""
    done = threading.Semaphore(0)
    failures: list[PutResult] = []

    def on_done(result: PutResult) -> None:
        if result.outcome is not PutOutcome.STORED:
            failures.append(result)
        done.release()

    for i, key in enumerate(keys):
        tier.put(PutJob(key, pages[i], num_tokens, tenant, on_done))
    for _ in keys:
        done.acquire()
    require(not failures, f"bench put failed: {failures[0] if failures else ''}")
