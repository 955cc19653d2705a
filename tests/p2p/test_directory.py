"""The directory never claims a chunk no live announcement holds: a state machine of peers
announcing adds, removes and snapshots (some keys malformed, some past the peer's cap), and
dropping out, against a plain model. Then what a peer may cost: only well-formed claims,
at most ``max_keys_per_peer`` of them."""

from __future__ import annotations

import logging
import os
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.p2p.directory import MAX_KEYS_PER_PEER, Directory

PEERS = st.sampled_from(["a:1", "b:2", "c:3"])
FP1, FP2 = "0123456789abcdef", "fedcba9876543210"  # as Fingerprint.hex() makes them
FPS = st.sampled_from([FP1, FP2])
KEYS = [bytes([i]) * 16 for i in range(8)]
BAD_KEYS = [b"", b"\x01" * 15, b"\x02" * 17]  # never a ChunkKey: ignored, never claimed
KEY_LISTS = st.lists(st.sampled_from(KEYS + BAD_KEYS), max_size=6)
CAP = 5  # below the 8 keys x 2 fingerprints one peer can name: the cap is reached


class DirectoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Directory(max_keys_per_peer=CAP)
        self.model: dict[str, dict[str, set[bytes]]] = {}

    @rule(peer=PEERS, fp=FPS, added=KEY_LISTS, removed=KEY_LISTS, reset=st.booleans())
    def announce(
        self, peer: str, fp: str, added: list[bytes], removed: list[bytes], reset: bool
    ) -> None:
        self.directory.apply(peer, fp, added, removed, reset=reset)
        fps = self.model.setdefault(peer, {})
        held = fps.setdefault(fp, set())
        if reset:
            held.clear()
        held.difference_update(removed)
        for key in added:
            total = sum(len(keys) for keys in fps.values())
            if len(key) == 16 and key not in held and total < CAP:
                held.add(key)

    @rule(peer=PEERS)
    def peer_gone(self, peer: str) -> None:
        expected = sum(len(keys) for keys in self.model.pop(peer, {}).values())
        assert self.directory.drop_peer(peer) == expected

    @invariant()
    def claims_are_exactly_the_live_holdings(self) -> None:
        for fp in (FP1, FP2):
            for key, holder in zip(KEYS, self.directory.holders(fp, KEYS), strict=True):
                holding = {p for p, fps in self.model.items() if key in fps.get(fp, set())}
                if holding:
                    assert holder in holding
                else:
                    assert holder is None
            assert self.directory.holders(fp, BAD_KEYS) == [None] * len(BAD_KEYS)
        counts = {p: sum(len(k) for k in fps.values()) for p, fps in self.model.items()}
        assert self.directory.peers() == {p: n for p, n in counts.items() if n}
        assert all(n <= CAP for n in self.directory.peers().values())


TestDirectory = DirectoryMachine.TestCase
TestDirectory.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [seed.to_bytes(4, "big") + i.to_bytes(12, "big") for i in range(n)]


@pytest.mark.parametrize(
    "fingerprint",
    ["", "f1", "0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", "0123456789abcdeg"],
)
def test_a_fingerprint_fingerprint_hex_never_makes_is_ignored(fingerprint: str) -> None:
    directory = Directory()
    directory.apply("a:1", fingerprint, keys(3), [], reset=True)
    assert directory.peers() == {} and directory.holders(fingerprint, keys(3)) == [None] * 3
    assert directory.ignored.messages == 1
    assert directory._holders == {} and directory._by_peer == {}  # nothing kept of it


def test_malformed_keys_are_ignored_and_counted_the_rest_claimed() -> None:
    directory = Directory()
    good = keys(2)
    directory.apply("a:1", FP1, [good[0], b"short", good[1], b"x" * 32], [])
    assert directory.holders(FP1, good) == ["a:1", "a:1"]
    assert directory.peers() == {"a:1": 2} and directory.ignored.keys == 2


def test_a_peer_past_its_cap_loses_further_claims_until_it_removes_some(
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory = Directory(max_keys_per_peer=4)
    mine = keys(6)
    with caplog.at_level(logging.WARNING, logger="kvtier.p2p.directory"):
        directory.apply("a:1", FP1, mine[:3], [])
        directory.apply("a:1", FP2, mine[3:], [])  # the cap counts every fingerprint
        directory.apply("a:1", FP2, mine[4:], [])  # again: counted again, logged once
    assert directory.peers() == {"a:1": 4}
    assert directory.holders(FP2, mine[3:]) == ["a:1", None, None]
    assert directory.ignored.over_cap == 4
    assert len([r for r in caplog.records if "cap" in r.getMessage()]) == 1
    directory.apply("b:2", FP1, mine, [])  # another peer has a cap of its own
    assert directory.peers() == {"a:1": 4, "b:2": 4}
    directory.apply("a:1", FP1, [mine[5]], [mine[0]])  # one removed: room for one
    assert directory.holders(FP1, [mine[0], mine[5]]) == ["b:2", "a:1"]
    assert directory.peers()["a:1"] == 4
    directory.apply("a:1", FP1, mine[:2], [], reset=True)  # a snapshot replaces: room again
    assert directory.peers()["a:1"] == 3  # 2 of FP1, 1 of FP2
    assert directory.drop_peer("a:1") == 3 and directory.peers() == {"b:2": 4}


def test_announcements_cost_the_follower_a_bounded_amount_of_memory() -> None:
    """A peer naming 200k keys and 20k fingerprints (of nothing) holds at most the cap."""
    cap = 10_000
    directory = Directory(max_keys_per_peer=cap)
    raw = os.urandom(16 * 200_000)
    flood = [raw[i : i + 16] for i in range(0, len(raw), 16)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, len(flood), 65_536):
            directory.apply("a:1", FP1, flood[start : start + 65_536], [])
        for i in range(20_000):
            directory.apply("a:1", f"{i:016x}", [], [], reset=True)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert directory.peers() == {"a:1": cap}
    assert directory.ignored.over_cap == 200_000 - cap
    assert grown < cap * 1024  # ~400 bytes a claim; unbounded it was ~75 MiB here
    assert MAX_KEYS_PER_PEER * 400 < 128 << 20  # the default cap: ~100 MiB a peer at most
