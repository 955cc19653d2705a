"""Which peer holds which chunk: this server's own copy of what its peers announced.

Kept true the way kvtier's KV events are: a peer announces every chunk its CPU tier adds and
every one it loses (``Tier.add_membership_listener``), and what it said stays here only while
its announcement stream is alive::

    peer's stream                         the directory
    connected, Holdings(reset) snapshot   replace what it held per fingerprint
    Holdings(added, removed)              apply
    heartbeat (empty Holdings)            nothing: it is alive
    silent past p2p_lease_secs, EOF,
    error, or this server closing         forget every chunk of that peer (drop_peer)

So a lookup is a dictionary probe here (no round trip), a dead peer's chunks are gone within
the lease, and a peer restarted empty says so in its first snapshot. A claim can still be
stale by the time it is pulled (evicted since): that pull is a miss, never data.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.keys import ChunkKey


class Directory:
    def __init__(self) -> None:
        # fingerprint -> key -> peers that announced it (most recent last)
        self._holders: dict[str, dict[ChunkKey, list[str]]] = {}
        # peer -> fingerprint -> its keys, to forget a peer at once
        self._by_peer: dict[str, dict[str, set[ChunkKey]]] = {}
        self._lock = threading.Lock()

    def apply(
        self,
        peer: str,
        fingerprint: str,
        added: Sequence[ChunkKey],
        removed: Sequence[ChunkKey],
        reset: bool = False,
    ) -> None:
        with self._lock:
            if reset:
                self._forget(peer, fingerprint)
            mine = self._by_peer.setdefault(peer, {}).setdefault(fingerprint, set())
            holders = self._holders.setdefault(fingerprint, {})
            for key in removed:
                if key in mine:
                    mine.discard(key)
                    self._unlink(holders, key, peer)
            for key in added:
                if key not in mine:
                    mine.add(key)
                    holders.setdefault(key, []).append(peer)

    def drop_peer(self, peer: str) -> int:
        """Forget everything ``peer`` announced; returns how many chunks that was."""
        with self._lock:
            fingerprints = list(self._by_peer.get(peer, {}))
            return sum(self._forget(peer, fp) for fp in fingerprints)

    def holders(self, fingerprint: str, keys: Sequence[ChunkKey]) -> list[str | None]:
        """Per key, a peer that announced it (the latest to), or None."""
        with self._lock:
            holders = self._holders.get(fingerprint, {})
            return [h[-1] if (h := holders.get(key)) else None for key in keys]

    def peers(self) -> dict[str, int]:
        """Each peer with something announced, and how many chunks it holds (all models)."""
        with self._lock:
            return {
                peer: sum(len(keys) for keys in fps.values())
                for peer, fps in self._by_peer.items()
                if any(fps.values())
            }

    def _forget(self, peer: str, fingerprint: str) -> int:
        keys = self._by_peer.get(peer, {}).pop(fingerprint, set())
        holders = self._holders.get(fingerprint, {})
        for key in keys:
            self._unlink(holders, key, peer)
        return len(keys)

    @staticmethod
    def _unlink(holders: dict[ChunkKey, list[str]], key: ChunkKey, peer: str) -> None:
        peers = holders.get(key)
        if peers is None:
            return
        if peer in peers:
            peers.remove(peer)
        if not peers:
            del holders[key]
