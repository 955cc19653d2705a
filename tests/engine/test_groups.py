"""Group-structured chunks through the engine's tiers: a Gemma-3-like layout (a sliding-window
group that keeps only the last ``keep`` tokens of each chunk, and a full group) stores less,
serves back exactly the tokens it keeps, and a chunk is every group or a miss: a corrupt
part names its group in explain, a deleted record is a miss from there on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier import Config, Engine
from kvtier.observability import explain as ex
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.records import HEADER_SIZE
from tests.conftest import make_kv, make_tokens
from tests.group_layouts import CHUNK, GEMMA, SLIDING, kept
from tests.redis_servers import RedisServer

PER_LAYER_TOKEN = 2 * 2 * 8 * 4  # K and V x heads x dim x fp32


def config(**overrides: object) -> Config:
    values: dict[str, object] = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": f"{8 * GEMMA.chunk_bytes(CHUNK)}B",
        **overrides,
    }
    return Config.load(overrides=values, env={})


def disk_config(path: Path) -> Config:
    return config(
        local_cpu=False,
        use_only_staging_buffer=True,
        local_disk=str(path),
        max_local_disk_size=f"{16 * (GEMMA.chunk_bytes(CHUNK) + HEADER_SIZE)}B",
    )


def outcomes(engine: Engine, rid: str) -> list[str]:
    record = engine.observer.explain.get(rid)
    assert record is not None
    return [f"found:{c['tier']}" if c["found"] else c["reason"] for c in record["chunks"]]


def test_a_chunk_page_holds_each_group_s_share() -> None:
    full = 2 * PER_LAYER_TOKEN * CHUNK
    assert GEMMA.chunk_bytes(CHUNK) == full + 2 * PER_LAYER_TOKEN * 6
    assert GEMMA.chunk_bytes(CHUNK) < GEMMA.token_bytes() * CHUNK


@pytest.mark.parametrize("where", ["cpu", "disk", "redis"])
def test_group_chunks_come_back_as_stored_from_every_tier(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tokens = make_tokens(3 * CHUNK + 5)
    kv = make_kv(len(tokens), layout=GEMMA)
    if where == "cpu":
        cfg = config()
    elif where == "disk":
        cfg = disk_config(tmp_path)
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        server.client().flushall()
        cfg = config(local_cpu=False, use_only_staging_buffer=True, remote_url=server.url)
    with Engine(cfg, GEMMA, model_name="gemma-like") as writer:
        assert writer.store(tokens, kv) == 3
        assert writer.flush(10)
        # Lower tiers: a second engine, whose CPU tier is empty (a new process's view).
        fresh = where != "cpu"
        reader = Engine(cfg, GEMMA, model_name="gemma-like").open() if fresh else writer
        try:
            assert reader.lookup(tokens, "r").tokens == 3 * CHUNK
            out = reader.retrieve(tokens, "r")
            reader.end_request("r")
            assert torch.equal(out, kept(kv[:, :, : 3 * CHUNK], GEMMA))
            assert reader.check_invariants() == []
        finally:
            if reader is not writer:
                reader.close()
    if where == "disk":
        sizes = {p.stat().st_size for p in tmp_path.rglob("*.kvc")}
        assert sizes == {HEADER_SIZE + GEMMA.chunk_bytes(CHUNK)}


@pytest.mark.parametrize(("offset", "group"), [(10, SLIDING), (-7, "full:1,3")])
def test_a_corrupt_group_part_is_a_miss_and_explain_names_the_group(
    offset: int, group: str, tmp_path: Path
) -> None:
    """A byte flipped in one group's part of the second chunk: that chunk and what follows
    are a miss (never a partial state), and explain names the group whose bytes differ."""
    tokens = make_tokens(3 * CHUNK)
    kv = make_kv(len(tokens), layout=GEMMA)
    cfg = disk_config(tmp_path)
    with Engine(cfg, GEMMA, model_name="gemma-like") as engine:
        engine.store(tokens, kv)
        assert engine.flush(10)
        second = engine.keychain.keys(tokens, include_partial=False)[1].key
        (victim,) = [p for p in tmp_path.rglob("*.kvc") if second.hex() in p.name]
        raw = bytearray(victim.read_bytes())
        raw[HEADER_SIZE + offset if offset > 0 else offset] ^= 0xFF
        victim.write_bytes(bytes(raw))
        assert engine.lookup(tokens, "r").tokens == 3 * CHUNK
        out = engine.retrieve(tokens, "r")
        assert out.shape[2] == CHUNK
        assert torch.equal(out, kept(kv[:, :, :CHUNK], GEMMA))
        assert outcomes(engine, "r") == ["found:disk", ex.CHECKSUM_FAILURE, ex.NOT_CONTIGUOUS]
        record = engine.observer.explain.get("r")
        assert record is not None
        assert f"KV-cache group {group}" in record["chunks"][1]["detail"]
        engine.end_request("r")
        assert engine.check_invariants() == []


def test_a_deleted_record_is_a_miss_from_there_on(tmp_path: Path) -> None:
    """Every group of a chunk is in one record: deleting it loses the chunk whole, and the
    chunks after it are not contiguous."""
    # Tokens of its own: explain's fingerprint registry is process-wide, and another test's
    # store of the same tokens under another layout would read as a fingerprint mismatch.
    tokens = make_tokens(3 * CHUNK, seed=130)
    cfg = disk_config(tmp_path)
    with Engine(cfg, GEMMA, model_name="gemma-like") as engine:
        engine.store(tokens, make_kv(len(tokens), layout=GEMMA))
        assert engine.flush(10)
    second = (
        Engine(cfg, GEMMA, model_name="gemma-like")
        .keychain.keys(tokens, include_partial=False)[1]
        .key
    )
    (victim,) = [p for p in tmp_path.rglob("*.kvc") if second.hex() in p.name]
    victim.unlink()
    with Engine(cfg, GEMMA, model_name="gemma-like") as engine:
        # A restart trusts the saved index and checks the directory in the background: a
        # file deleted while the tier was closed leaves the index once that check is done.
        disk = engine.tier("disk")
        assert isinstance(disk, DiskTier) and disk.index_checked(30.0)
        assert engine.lookup(tokens, "r").tokens == CHUNK
        assert outcomes(engine, "r")[1:] == [ex.NOT_STORED, ex.NOT_CONTIGUOUS]
        engine.end_request("r")
