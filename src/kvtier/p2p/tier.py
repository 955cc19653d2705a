"""The P2P tier: the chunks other hosts' servers announced, read by pulling them.

Last in an engine's search order (after disk and Redis: a local read is cheaper than a
peer's network). Its protocol, in :mod:`kvtier.storage.base`'s terms:

* ``contains``: the directory's answer, this process's copy (no round trip);
* ``pin``: True without a guarantee, as a shared remote store's (a peer evicts on its own):
  a chunk gone by the time it is pulled is a miss, and the engine recomputes from there;
* ``get_many_into``: one transfer per peer holding a run of the items, every payload
  received into its own page and checked; the whole read within ``blocking_timeout_secs``;
* no writes (``accepts_puts`` False): the CPU tier is what peers read, through its owner's
  announcements, so a chunk loaded from a peer is copied to CPU (``local_cpu``) and
  announced by this server in turn.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.p2p.directory import Directory
from kvtier.p2p.fetch import Fetcher
from kvtier.storage.base import PutJob, PutOutcome, Tier, TierUsage


class P2PTier(Tier):
    name = "p2p"
    medium = None  # what peers hold is theirs to publish
    accepts_puts = False

    def __init__(
        self,
        directory: Directory,
        fetcher: Fetcher,
        fingerprint: str,
        layout: KVLayout,
        timeout: float,
    ) -> None:
        super().__init__()
        self.directory = directory
        self.fetcher = fetcher
        self.fingerprint = fingerprint
        self.layout = layout
        self.timeout = timeout

    def open(self) -> None:
        return None

    def close(self) -> None:
        return None  # the node owns the fetcher's connections

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [peer is not None for peer in self.directory.holders(self.fingerprint, keys)]

    def pin(self, key: ChunkKey) -> bool:
        return True

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        return self.get_many_into([(key, out)])[0]

    def get_many_into(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        deadline = time.monotonic() + self.timeout
        peers = self.directory.holders(self.fingerprint, [key for key, _ in items])
        results: list[int | None] = [None] * len(items)
        by_peer: dict[str, list[int]] = {}
        for i, peer in enumerate(peers):
            if peer is not None:
                by_peer.setdefault(peer, []).append(i)
        for peer, positions in by_peer.items():
            got = self.fetcher.fetch(
                peer, self.fingerprint, self.layout, [items[i] for i in positions], deadline
            )
            for i, tokens in zip(positions, got, strict=True):
                results[i] = tokens
        for tokens in results:
            if tokens is None:
                self.counters.misses += 1
            else:
                self.counters.hits += 1
                self.counters.bytes_read += self.layout.payload_bytes(tokens)
        return results

    def put(self, job: PutJob) -> None:
        job.done(PutOutcome.EXISTS, "the p2p tier takes no writes")

    def remove(self, key: ChunkKey) -> bool:
        return False  # a peer's chunk is the peer's

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, 0)

    def clear(self) -> int:
        return 0
