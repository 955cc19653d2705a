"""Peer-to-peer sharing between hosts' ``kvtier server``s: a miss here is a hit on a peer.

``node``: the server's P2P port (announces its CPU tiers' chunks, serves pulls) and its
followers of each configured peer; ``announce``: what a node tells its followers (a snapshot,
then each change, heartbeats); ``directory``: what the peers hold, from their
announcements; ``tier``: the lower tier an engine reads peers' chunks through; ``fetch``:
one pull; ``protocol``: the wire (PD's handshake and checksum).
"""
