"""One ``Hit`` from the engine to vLLM's scheduler: the same class on both local wires, its
invariant held where it is made (also when decoded from a peer), and its frames the bytes
the wires carried before it was one type."""

from __future__ import annotations

import msgspec
import pytest

import kvtier
from kvtier import Hit, InputError, ProtocolError
from kvtier.framing import Framing
from kvtier.integrations.vllm import rpc
from kvtier.server import protocol as wire

WIRES: list[Framing[object]] = [wire.FRAMING, rpc.FRAMING]  # type: ignore[list-item]


def test_one_class_answers_every_lookup() -> None:
    assert kvtier.Hit is wire.Hit is rpc.Hit
    assert Hit(64) == Hit(64, 0) and Hit(64, 32) != Hit(64, 0)


@pytest.mark.parametrize(("tokens", "cpu_tokens"), [(16, 32), (16, -1), (-16, 0), (-16, -16)])
def test_a_hit_outside_its_invariant_is_refused_where_it_is_made(
    tokens: int, cpu_tokens: int
) -> None:
    with pytest.raises(InputError) as caught:
        Hit(tokens, cpu_tokens)
    assert str(caught.value) == (
        f"a Hit needs 0 <= cpu_tokens <= tokens, got tokens={tokens}, cpu_tokens={cpu_tokens}"
    )


@pytest.mark.parametrize("framing", WIRES, ids=["server", "vllm-channel"])
def test_a_peers_hit_outside_the_invariant_is_a_malformed_message(framing: Framing[object]) -> None:
    body = msgspec.msgpack.encode({"type": "Hit", "tokens": 16, "cpu_tokens": 32})
    with pytest.raises(ProtocolError, match="malformed message: a Hit needs 0 <= cpu_tokens"):
        framing.decode_body(body)
    good = msgspec.msgpack.encode({"type": "Hit", "tokens": 16, "cpu_tokens": 16})
    assert framing.decode_body(good) == Hit(16, 16)


def test_the_frames_are_the_bytes_the_two_wire_hits_sent() -> None:
    # Taken from the server's and the channel's own Hit classes before they became this one.
    body = "83a474797065a3486974a6746f6b656e7340aa6370755f746f6b656e7320"
    assert wire.encode(Hit(64, 32)) == bytes.fromhex("4b5653010000001e" + body)
    assert rpc.FRAMING.encode(Hit(64, 32)) == bytes.fromhex("4b564c010000001e" + body)
    # the server's wire let cpu_tokens out (an older client): it still reads as 0
    assert wire.FRAMING.decode_body(msgspec.msgpack.encode({"type": "Hit", "tokens": 5})) == Hit(5)
