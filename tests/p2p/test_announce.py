"""A live but quiet peer stays claimed: with nothing to announce it still sends a heartbeat
each third of ``p2p_lease_secs``, so its follower, which drops a peer silent for a whole
lease, keeps every chunk it claimed for as long as the peer lives.

Heartbeats any rarer than a lease (every three leases, say) pass every test that looks once:
the follower drops the peer a lease after the last message and claims its chunks again a
moment after redialing. So the follower's directory is read continuously, for several leases.
"""

from __future__ import annotations

import time

from kvtier.p2p.node import P2PNode
from tests.p2p.node_helpers import TIMEOUT, TOKEN, holding_node
from tests.server.server_helpers import wait_until

LEASE = 1.0  # short, so several leases pass quickly; long enough for a loaded test machine
QUIET_LEASES = 4


def test_a_quiet_peer_stays_claimed_lease_after_lease() -> None:
    with holding_node(LEASE) as held:
        follower = P2PNode(
            "127.0.0.1:0", [held.node.address], token=TOKEN, lease_secs=LEASE, timeout=TIMEOUT
        ).open()
        try:
            directory = follower.directory
            wait_until(
                lambda: None not in directory.holders(held.fingerprint, held.keys),
                what="the follower hears the peer's snapshot",
            )
            heard = time.monotonic()
            while (quiet := time.monotonic() - heard) < QUIET_LEASES * LEASE:
                claims = directory.holders(held.fingerprint, held.keys)
                assert None not in claims, (
                    f"the peer's chunks were dropped {quiet:.2f}s into its quiet spell "
                    f"(lease {LEASE:g}s): its heartbeats came too seldom"
                )
                time.sleep(0.01)
            assert directory.peers() == {held.node.address: len(held.keys)}
        finally:
            follower.close()
