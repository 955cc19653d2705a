"""The directory never claims a chunk no live announcement holds: a state machine of peers
announcing adds, removes and snapshots, and dropping out, against a plain model."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.p2p.directory import Directory

PEERS = st.sampled_from(["a:1", "b:2", "c:3"])
FPS = st.sampled_from(["f1", "f2"])
KEYS = [bytes([i]) * 16 for i in range(8)]
KEY_LISTS = st.lists(st.sampled_from(KEYS), max_size=6)


class DirectoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Directory()
        self.model: dict[str, dict[str, set[bytes]]] = {}

    @rule(peer=PEERS, fp=FPS, added=KEY_LISTS, removed=KEY_LISTS, reset=st.booleans())
    def announce(
        self, peer: str, fp: str, added: list[bytes], removed: list[bytes], reset: bool
    ) -> None:
        self.directory.apply(peer, fp, added, removed, reset=reset)
        held = self.model.setdefault(peer, {}).setdefault(fp, set())
        if reset:
            held.clear()
        held.difference_update(removed)
        held.update(added)

    @rule(peer=PEERS)
    def peer_gone(self, peer: str) -> None:
        expected = sum(len(keys) for keys in self.model.pop(peer, {}).values())
        assert self.directory.drop_peer(peer) == expected

    @invariant()
    def claims_are_exactly_the_live_holdings(self) -> None:
        for fp in ("f1", "f2"):
            for key, holder in zip(KEYS, self.directory.holders(fp, KEYS), strict=True):
                holding = {p for p, fps in self.model.items() if key in fps.get(fp, set())}
                if holding:
                    assert holder in holding
                else:
                    assert holder is None
        counts = {p: sum(len(k) for k in fps.values()) for p, fps in self.model.items()}
        assert self.directory.peers() == {p: n for p, n in counts.items() if n}


TestDirectory = DirectoryMachine.TestCase
TestDirectory.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
