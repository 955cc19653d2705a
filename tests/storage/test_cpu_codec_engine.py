"""An engine whose CPU tier stores through a codec (``cpu_codec``): the same RAM holds more
chunks, a hit longer than the staging pages still loads whole into the caller's tensor, a
reader of pages gets what the pages allow, disk hits are copied back through the codec, and
the identity codec keeps the zero-copy tier."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.storage.cpu import CpuTier
from kvtier.storage.cpu_coded import CodedCpuTier
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config

EngineFactory = Callable[..., Engine]
CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)
# make_kv's values are multiples of 2**-13 up to 4: exact in fp32, within fp8/int8 error.
REL_ERROR = {"lossless": 0.0, "fp8": 0.05, "int8": 0.01}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("codec", sorted(REL_ERROR))
def test_a_hit_longer_than_the_staging_pages_loads_whole(
    engine_factory: EngineFactory, codec: str
) -> None:
    engine = engine_factory(cpu_chunks=32, cpu_codec=codec, cpu_codec_staging=f"{CHUNK_BYTES}B")
    assert engine.num_pages == 1 and isinstance(engine.tier("cpu"), CodedCpuTier)
    tokens, kv = make_tokens(160), make_kv(160)
    assert engine.store(tokens, kv) == 10  # ten chunks through one staging page
    hit = engine.lookup(tokens, "r")
    assert (hit.tokens, hit.cpu_tokens) == (160, 160)
    got = engine.retrieve(tokens, "r")
    assert got.shape[2] == 160 and rel_error(got, kv) <= REL_ERROR[codec]
    assert engine.check_invariants() == []
    engine.end_request("r")
    assert engine.check_invariants() == []


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_the_same_ram_holds_more_chunks_than_without_a_codec(
    engine_factory: EngineFactory, codec: str
) -> None:
    held = {}
    for name in ("identity", codec):
        engine = engine_factory(cpu_chunks=32, cpu_codec=name)
        engine.store(make_tokens(96 * SMALL_CHUNK), make_kv(96 * SMALL_CHUNK))
        held[name] = len(engine.tier("cpu") or ())
    # fp32 with 8-wide heads: a byte per element and a 4-byte scale per 8 (1.5 bytes of 4),
    # in the 30 of 32 chunks' bytes left after the 2 staging pages (1/16).
    coded = engine.tier("cpu")
    assert isinstance(coded, CodedCpuTier) and engine.num_pages == 2
    assert coded.store.num_pages == 30 * CHUNK_BYTES // coded.store.page_bytes
    assert held["identity"] == 32 and held[codec] == coded.store.num_pages >= 2.3 * 32


def test_a_reader_of_pages_gets_what_the_staging_pages_hold(
    engine_factory: EngineFactory,
) -> None:
    engine = engine_factory(
        cpu_chunks=32, cpu_codec="int8", cpu_codec_staging=f"{3 * CHUNK_BYTES}B"
    )
    tokens, kv = make_tokens(96), make_kv(96)
    engine.store(tokens, kv)
    end, pages = engine.pages().lease_pages(tokens, "r")
    assert end == 3 * SMALL_CHUNK and len(pages) == 3  # one chunk per staging page
    pool = engine._open_parts()[0].pool  # the pages a server client maps
    assert pool is not None
    for page, start, n in pages:
        got = torch.empty(SMALL_LAYOUT.kv_shape(n), dtype=SMALL_LAYOUT.dtype)
        SMALL_LAYOUT.unpack(pool.page_bytes_view(page, SMALL_LAYOUT.payload_bytes(n)), got)
        assert rel_error(got, kv[:, :, start : start + n]) <= REL_ERROR["int8"]
    engine.end_request("r")
    assert engine.check_invariants() == [] and pool.free_pages == pool.num_pages


def test_disk_hits_are_copied_back_through_the_codec(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    tiers = {"local_disk": str(tmp_path), "max_local_disk_size": "1MiB"}
    tokens, kv = make_tokens(64), make_kv(64)
    first = engine_factory(**tiers)
    first.store(tokens, kv)
    assert first.flush(10.0)
    engine = engine_factory(cpu_codec="fp8", **tiers)
    assert engine.lookup(tokens, "a").cpu_tokens == 0
    assert rel_error(engine.retrieve(tokens, "a"), kv) == 0.0  # the disk's exact bytes
    engine.end_request("a")
    assert engine.lookup(tokens, "b").cpu_tokens == 64  # now in the coded CPU tier
    assert 0 < rel_error(engine.retrieve(tokens, "b"), kv) <= REL_ERROR["fp8"]
    engine.end_request("b")


def test_identity_keeps_the_zero_copy_tier(engine_factory: EngineFactory) -> None:
    engine = engine_factory(cpu_chunks=8)
    cpu = engine.tier("cpu")
    assert type(cpu) is CpuTier and cpu.resident and engine.num_pages == 8
    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    end, pages = engine.pages().lease_pages(tokens, "r")
    assert end == 32 and {p for p, _, _ in pages} <= cpu.owned_pages()  # the entries' pages
    engine.end_request("r")


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"cpu_codec": "fp8", "cpu_codec_staging": f"{CHUNK_BYTES - 1}B"}, "cpu_codec_staging"),
        ({"cpu_codec": "fp8", "cpu_codec_staging": f"{8 * CHUNK_BYTES}B"}, "cpu_codec_staging"),
        ({"cpu_codec": "lossless", "cpu_chunks": 1}, "max_local_cpu_size"),
    ],
)
def test_a_split_that_leaves_no_room_names_the_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Engine(small_config(**values), SMALL_LAYOUT, model_name="m")
    assert info.value.key == key and "staging" in str(info.value)


def test_a_codec_is_refused_where_the_cpu_memory_is_staging_only() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(
            env={},
            overrides={
                "cpu_codec": "fp8",
                "local_cpu": False,
                "use_only_staging_buffer": True,
                "local_disk": "/tmp/x",
                "max_local_disk_size": "1MiB",
            },
        )
    assert info.value.key == "cpu_codec" and "'identity'" in str(info.value)
