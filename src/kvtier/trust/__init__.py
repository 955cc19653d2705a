"""Trust between kvtier processes: the one owner of every connection another process dials.

PD push (a prefiller dials a decoder's receiver), PD pull (a decoder dials a prefiller's
source) and P2P (servers dial each other's port) all open with the same handshake and are
held to the same bounds:

* :mod:`~kvtier.trust.proofs`: what a proof binds (protocol, the prover's side, both
  identities, both nonces), so a proof made on one connection is worthless on any other;
* :mod:`~kvtier.trust.handshake`: the messages, a header's worth of memory before a peer has
  proved itself, one deadline for the whole exchange, causes named to both sides;
* :mod:`~kvtier.trust.guard`: caps (connections, and connections not yet authenticated) and a
  watchdog for every later wait;
* :mod:`~kvtier.trust.port`: the listener every port uses; :mod:`~kvtier.trust.dial`: the
  dialer every client uses, with :class:`~kvtier.trust.dial.Backoff` for redials;
* :mod:`~kvtier.trust.peer_text`: a peer's words escaped and bounded before they reach a log.

What it does not give: confidentiality or integrity of the bytes after the handshake. An
attacker on the path between two honest processes (or one an honest dialer was told to dial)
can read and alter them: across hosts, run these ports on a network you trust or inside a
tunnel (docs/security.md).
"""
