"""A LoRA adapter and images key a request's chunks through Redis as they do in memory: an
engine of another process (here: another Engine, an empty CPU tier) finds in the shared
Redis exactly the chunks the writer's extra keys allow, byte for byte, and nothing else."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier import Engine
from kvtier.request_salt import ExtraKeys
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.redis_servers import RedisServer

TOKENS, KV = make_tokens(4 * SMALL_CHUNK, seed=81), make_kv(4 * SMALL_CHUNK, seed=81)
ADAPTER_A = ExtraKeys(adapter=b"A" * 16, labels=("lora adapter 'A'",))
ADAPTER_B = ExtraKeys(adapter=b"B" * 16, labels=("lora adapter 'B'",))


def image(digest: bytes) -> ExtraKeys:
    """One image in chunk 1 (tokens 20..27 of 16-token chunks)."""
    return ExtraKeys(items=((SMALL_CHUNK + 4, SMALL_CHUNK + 12, digest),), labels=("image",))


@pytest.fixture
def url() -> Iterator[str]:
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.cleanup()


def engine(url: str) -> Engine:
    config = small_config(remote_url=url, cpu_chunks=16)
    return Engine(config, SMALL_LAYOUT, model_name="extra-keys").open()


def hit_through_redis(url: str, salt: ExtraKeys | None) -> tuple[int, int]:
    """A fresh reader's hit for TOKENS under ``salt`` and its Redis hits (the bytes checked)."""
    with engine(url) as reader, reader.request("r"):
        tokens = reader.lookup(TOKENS, "r", cache_salt=salt).tokens
        if tokens:
            got = reader.retrieve(TOKENS, "r", cache_salt=salt)
            assert torch.equal(got, KV[:, :, :tokens])
        redis_hits = int(reader.stats()["tiers"]["redis"]["hits"])
    return tokens, redis_hits


def test_a_lora_adapters_chunks_are_found_in_redis_only_under_that_adapter(url: str) -> None:
    with engine(url) as writer:
        assert writer.store(TOKENS, KV, cache_salt=ADAPTER_A) == 4
        assert writer.flush(10.0)
    assert hit_through_redis(url, ADAPTER_A) == (4 * SMALL_CHUNK, 4)
    assert hit_through_redis(url, ADAPTER_B) == (0, 0)  # every chunk keyed by the adapter
    assert hit_through_redis(url, None) == (0, 0)


def test_an_images_chunks_are_found_in_redis_only_under_that_image(url: str) -> None:
    with engine(url) as writer:
        assert writer.store(TOKENS, KV, cache_salt=image(b"image-1" * 2)) == 4
        assert writer.flush(10.0)
    assert hit_through_redis(url, image(b"image-1" * 2)) == (4 * SMALL_CHUNK, 4)
    # Chunk 0 precedes the image: plain text, shared with any image or none (as in vLLM);
    # from chunk 1 on the other image's KV differs.
    assert hit_through_redis(url, image(b"image-2" * 2)) == (SMALL_CHUNK, 1)
    assert hit_through_redis(url, None) == (SMALL_CHUNK, 1)
