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

What a peer says is checked before it costs memory here (a peer proved the token, but a
buggy or compromised one must not grow this server without bound)::

    fingerprint   Fingerprint.hex(): 16 lowercase hex digits, else the message is ignored
    each key      a ChunkKey of KEY_BYTES (16) bytes, else that key is ignored
    keys per peer at most max_keys_per_peer (all fingerprints together); further additions
                  are dropped until the peer removes some

Everything ignored is counted (:attr:`Directory.ignored`) and logged once per peer. Nothing
is raised: a dropped claim only costs a miss (a chunk not claimed is pulled from nowhere),
never a wrong hit, so the stream goes on.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.fingerprint import KEY_BYTES
from kvtier.keys import ChunkKey

log = logging.getLogger(__name__)

# Keys one peer may have claimed here at once. A claim costs ~370 bytes of the follower's RSS
# (1,000,000 announced keys measured +370 MiB: the key, its entries in two dicts and a set,
# its holders list), so this is ~100 MiB per peer at most. A CPU tier of 2**18 chunks is
# 768 GiB of a 0.5B model's 256-token chunks (3 MiB each) and far more of larger models': a
# real peer stays below it, and one past it only loses claims (misses, never wrong data).
MAX_KEYS_PER_PEER = 1 << 18
FINGERPRINT = re.compile(r"[0-9a-f]{16}")  # Fingerprint.hex(): 8 digest bytes in hex


@dataclass(slots=True)
class Ignored:
    """What peers announced that the directory did not take (totals over all peers)."""

    messages: int = 0  # a fingerprint that Fingerprint.hex() never makes: the whole message
    keys: int = 0  # a key that is not a ChunkKey of KEY_BYTES bytes
    over_cap: int = 0  # an addition past max_keys_per_peer


class Directory:
    def __init__(self, max_keys_per_peer: int = MAX_KEYS_PER_PEER) -> None:
        self.max_keys_per_peer = max_keys_per_peer
        # fingerprint -> key -> peers that announced it (most recent last)
        self._holders: dict[str, dict[ChunkKey, list[str]]] = {}
        # peer -> fingerprint -> its keys, to forget a peer at once
        self._by_peer: dict[str, dict[str, set[ChunkKey]]] = {}
        self._counts: dict[str, int] = {}  # peer -> its keys over every fingerprint
        self._warned: set[tuple[str, str]] = set()  # (peer, what): logged once each
        self.ignored = Ignored()
        self._lock = threading.Lock()

    def apply(
        self,
        peer: str,
        fingerprint: str,
        added: Sequence[ChunkKey],
        removed: Sequence[ChunkKey],
        reset: bool = False,
    ) -> None:
        """Take one Holdings message of ``peer``; what fails the checks in the module
        docstring is ignored and counted, never raised (the caller goes on reading)."""
        with self._lock:
            if not FINGERPRINT.fullmatch(fingerprint):
                self.ignored.messages += 1
                self._warn(peer, "fingerprint", f"a fingerprint {fingerprint[:40]!r}")
                return
            if reset:
                self._forget(peer, fingerprint)
            fps = self._by_peer.setdefault(peer, {})
            mine = fps.get(fingerprint, set())
            holders = self._holders.get(fingerprint, {})
            count = self._counts.get(peer, 0)
            for key in removed:
                if key in mine:
                    mine.discard(key)
                    self._unlink(holders, key, peer)
                    count -= 1
            bad = over = 0
            for key in added:
                if len(key) != KEY_BYTES:
                    bad += 1
                elif key not in mine:
                    if count >= self.max_keys_per_peer:
                        over += 1
                        continue
                    mine.add(key)
                    holders.setdefault(key, []).append(peer)
                    count += 1
            self._keep(peer, fingerprint, mine, holders, count)
            if bad:
                self.ignored.keys += bad
                self._warn(peer, "keys", f"{bad} keys not of {KEY_BYTES} bytes")
            if over:
                self.ignored.over_cap += over
                self._warn(peer, "cap", f"claims past {self.max_keys_per_peer} keys (its cap here)")

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
            return {peer: count for peer, count in self._counts.items() if count}

    def _keep(
        self,
        peer: str,
        fingerprint: str,
        mine: set[ChunkKey],
        holders: dict[ChunkKey, list[str]],
        count: int,
    ) -> None:
        """Store what apply changed; an empty set or table is not kept, so a peer naming
        fingerprints it holds nothing of costs nothing."""
        fps = self._by_peer[peer]
        if mine:
            fps[fingerprint] = mine
        else:
            fps.pop(fingerprint, None)
        if holders:
            self._holders[fingerprint] = holders
        else:
            self._holders.pop(fingerprint, None)
        if not fps:
            del self._by_peer[peer]
        if count:
            self._counts[peer] = count
        else:
            self._counts.pop(peer, None)

    def _forget(self, peer: str, fingerprint: str) -> int:
        fps = self._by_peer.get(peer, {})
        keys = fps.pop(fingerprint, set())
        if not fps:
            self._by_peer.pop(peer, None)
        holders = self._holders.get(fingerprint, {})
        for key in keys:
            self._unlink(holders, key, peer)
        if not holders:
            self._holders.pop(fingerprint, None)
        left = self._counts.get(peer, 0) - len(keys)
        if left:
            self._counts[peer] = left
        else:
            self._counts.pop(peer, None)
        return len(keys)

    def _warn(self, peer: str, what: str, detail: str) -> None:
        # Once per peer and kind: a peer repeating itself must not flood the log (peers come
        # from p2p_peers, so this set stays small); the counts in ``ignored`` keep going.
        if (peer, what) not in self._warned:
            self._warned.add((peer, what))
            log.warning("P2P peer %s announced %s: ignored (a miss here, never data)", peer, detail)

    @staticmethod
    def _unlink(holders: dict[ChunkKey, list[str]], key: ChunkKey, peer: str) -> None:
        peers = holders.get(key)
        if peers is None:
            return
        if peer in peers:
            peers.remove(peer)
        if not peers:
            del holders[key]
