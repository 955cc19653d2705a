"""A state model's checkpoint lookup through a real ``kvtier server``: the Lookup carries
``checkpoint_tokens``, so a chat's next turn resumes at the last turn's checkpoint as it
does in process (:mod:`kvtier.engine._checkpoints`), with the bytes stored."""

from __future__ import annotations

from tests.conftest import SMALL_CHUNK, make_kv, make_tokens
from tests.engine.test_checkpoints import next_turn_resumes_at_the_checkpoint
from tests.server.server_helpers import ServerProcess, open_client

UNIT = 4


def test_a_next_turn_resumes_at_the_last_turns_checkpoint_through_the_server(
    server: ServerProcess,
) -> None:
    first = make_tokens(SMALL_CHUNK + 2 * UNIT, seed=70)
    kv = make_kv(len(first), seed=71)
    turn = first + make_tokens(20, seed=72)
    model = "checkpoints-through-the-server"
    with open_client(server.url, model_name=model, save_unfull_chunk=True) as writer:
        assert writer.store(first, kv) == 2  # a chunk and the partial up to the checkpoint
    with open_client(server.url, model_name=model, save_unfull_chunk=True) as reader:
        next_turn_resumes_at_the_checkpoint(reader, first, kv, turn)
        assert reader.stats()["open_requests"] == 0
