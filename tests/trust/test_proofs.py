"""What a proof binds: change any one field of the transcript, or the side, and it fails."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.trust.proofs import NONCE_BYTES, Side, Transcript, new_nonce, proof, verify

TOKEN = "a-fleet-secret-of-32-characters!"


def transcript() -> Transcript:
    return Transcript("pd-push", "pd-sender/1", "pd-receiver/2", new_nonce(), new_nonce())


def test_the_token_never_travels_and_a_proof_verifies_for_its_own_side() -> None:
    t = transcript()
    mine = proof(TOKEN, Side.DIALER, t)
    assert TOKEN.encode() not in mine and len(mine) == 32
    assert verify(TOKEN, Side.DIALER, t, mine)
    assert not verify(TOKEN, Side.LISTENER, t, mine)  # a listener's never passes as a dialer's
    assert not verify("another-secret-of-32-characters!", Side.DIALER, t, mine)


@pytest.mark.parametrize(
    "field", ["protocol", "dialer", "listener", "dialer_nonce", "listener_nonce"]
)
def test_every_field_of_the_transcript_is_bound(field: str) -> None:
    t = transcript()
    mine = proof(TOKEN, Side.DIALER, t)
    value = getattr(t, field)
    other = new_nonce() if isinstance(value, bytes) else value + "x"
    assert not verify(TOKEN, Side.DIALER, dataclasses.replace(t, **{field: other}), mine)


def test_fields_cannot_slide_into_each_other() -> None:
    """Length-prefixed fields: moving a character from one identity to the next is another
    transcript (a separator-joined encoding would have made these equal)."""
    a = Transcript("p2p", "ab", "c", bytes(NONCE_BYTES), bytes(NONCE_BYTES))
    b = dataclasses.replace(a, dialer="a", listener="bc")
    assert proof(TOKEN, Side.DIALER, a) != proof(TOKEN, Side.DIALER, b)


def test_short_nonces_never_verify() -> None:
    t = dataclasses.replace(transcript(), dialer_nonce=b"")
    assert not verify(TOKEN, Side.DIALER, t, proof(TOKEN, Side.DIALER, t))
