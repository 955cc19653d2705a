"""Copies between device memory and host pages land before any host reader touches a page,
and no page is given back while a copy from it runs (kvtier.memory.device).

A GPU's copies are asynchronous; these machines have none, so a copy engine whose copies land
late (tests/memory/late_copies.py: held until code waits on their fence, never a timer) stands
in for one. Each scenario stores "device" KV and reads it back through a tier whose host side
reads the page (a disk writer and its checksum, a codec, a Redis writer, the kvtier server, a
PD sender), or loads into "device" memory and ends the request at once. Each scenario also runs
with a fence that lies ("landed" at once), the code that does not wait: there it must see wrong
bytes, so the scenario can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier import Engine
from kvtier.memory.device import LANDED, DeviceCopies, Direction
from kvtier.pd.sender import chunks_from_kv
from kvtier.server.client import ServerClient
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.memory.late_copies import LateCopies
from tests.pd.pd_helpers import decoder, fake_prefill, keychain, sender
from tests.redis_servers import RedisServer
from tests.server.server_helpers import InProcess, client_config, remove_tempdir, short_tempdir

TOKENS = 4 * SMALL_CHUNK
PAGE = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


def late(lying: bool) -> LateCopies:
    """Copies that land only when code waits on their fence, or at ``drain()``: code that does
    not wait reads before they land, however slow the machine (no timer to race)."""
    return LateCopies(lying=lying)


def device_kv(copies: LateCopies, seed: int) -> torch.Tensor:
    return copies.mark(make_kv(TOKENS, seed))


def stored_then_read(
    make_engine: Callable[[LateCopies | None], Engine], lying: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store device KV through one engine (closed: writes drained), retrieve it through a
    fresh one over the same tiers. Returns (stored, served)."""
    copies = late(lying)
    tokens, kv = make_tokens(TOKENS, seed), device_kv(copies, seed)
    with make_engine(copies) as engine:
        assert engine.store(tokens, kv) == TOKENS // SMALL_CHUNK
        assert engine.flush(10.0)
    copies.drain()
    with make_engine(None) as engine, engine.request("r"):
        hit = engine.lookup(tokens + [1], "r").tokens
        served = engine.retrieve(tokens + [1], "r")
    assert served.shape[2] == hit
    return kv, served


def served_right(stored: torch.Tensor, served: torch.Tensor) -> bool:
    """Every served token equals the stored one (a corrupt chunk is a miss: fewer tokens)."""
    return torch.equal(served, stored[:, :, : served.shape[2]]) and served.shape[2] == TOKENS


# -- stores: a host reader of the page waits for the copy ----------------------------------


def disk_engine(path: Path) -> Callable[[LateCopies | None], Engine]:
    def make(copies: LateCopies | None) -> Engine:
        # The CPU tier only stages the disk writes: a read after the restart is the file's.
        cfg = small_config(local_disk=str(path), max_local_disk_size="1MiB", cpu_chunks=8)
        return Engine(cfg, SMALL_LAYOUT, model_name="fence", copies=copies)

    return make


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_disk_after_a_restart_serves_the_bytes_the_device_held(tmp_path: Path, lying: bool) -> None:
    stored, served = stored_then_read(disk_engine(tmp_path), lying, seed=45001)
    assert served_right(stored, served) is not lying


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_a_coded_cpu_tier_encodes_the_bytes_the_device_held(lying: bool) -> None:
    copies = late(lying)
    tokens, kv = make_tokens(TOKENS, 45002), device_kv(copies, 2)
    cfg = small_config(cpu_chunks=16, cpu_codec="lossless", cpu_codec_staging=f"{PAGE}B")
    with Engine(cfg, SMALL_LAYOUT, model_name="fence", copies=copies) as engine:
        engine.store(tokens, kv)
        copies.drain()
        with engine.request("r"):
            engine.lookup(tokens + [1], "r")
            served = engine.retrieve(tokens + [1], "r")
    assert served_right(kv, served) is not lying


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_redis_serves_the_bytes_the_device_held(redis_server: RedisServer, lying: bool) -> None:
    seed = 45003 if lying else 45004  # each run its own keys in the module's server

    def make(copies: LateCopies | None) -> Engine:
        cfg = small_config(remote_url=redis_server.url, local_cpu=False, cpu_chunks=8)
        return Engine(cfg, SMALL_LAYOUT, model_name="fence", copies=copies)

    stored, served = stored_then_read(make, lying, seed)
    assert served_right(stored, served) is not lying


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_the_server_serves_the_bytes_a_client_copied_from_the_device(lying: bool) -> None:
    directory = short_tempdir()
    try:
        # The server's CPU memory only stages disk writes: what a reader gets is what the
        # server's disk writer read from the shared page when the client committed.
        server = InProcess(
            directory,
            chunk_size=SMALL_CHUNK,
            local_disk=str(Path(directory) / "disk"),
            max_local_disk_size="1MiB",
            local_cpu=False,
            use_only_staging_buffer=True,
        )
        try:
            copies = late(lying)
            tokens, kv = make_tokens(TOKENS, 45005), device_kv(copies, 5)
            writer = ServerClient(
                server.url, SMALL_LAYOUT, model_name="fence", config=client_config(),
                copies=copies,
            ).open()  # fmt: skip
            with writer:
                assert writer.store(tokens, kv) == TOKENS // SMALL_CHUNK
                assert writer.flush(10.0)
            copies.drain()
            reader = ServerClient(
                server.url, SMALL_LAYOUT, model_name="fence", config=client_config()
            ).open()
            with reader, reader.request("r"):
                reader.lookup(tokens + [1], "r")
                served = reader.retrieve(tokens + [1], "r")
        finally:
            server.close()
    finally:
        remove_tempdir(directory)
    assert served_right(kv, served) is not lying


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_a_pd_sender_sends_the_bytes_the_device_held(lying: bool) -> None:
    engine, receiver = decoder("tcp", pages=8)
    try:
        tokens = make_tokens(TOKENS, 45006)
        copies = late(lying)
        kv = copies.mark(fake_prefill(tokens))
        spans = keychain().keys(tokens, include_partial=True)
        tx = sender("tcp", receiver.port)
        tx._copies = copies  # the seam, as PDSender(copies=...) takes it
        with tx:
            tx.send("r", chunks_from_kv(spans, kv))
        copies.drain()
        with engine.request("r"):
            engine.lookup(tokens + [1], "r")
            served = engine.retrieve(tokens + [1], "r")
    finally:
        receiver.close()
        engine.close()
    assert served_right(kv, served) is not lying


# -- loads: no page is given back while a copy from it runs --------------------------------


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_a_page_is_reused_only_after_the_load_from_it_landed(lying: bool) -> None:
    """Load A into device memory and end the request at once; B's store then reuses A's
    pages (the pool holds only A's chunks). The device must still get A."""
    copies = late(lying)
    chunks = TOKENS // SMALL_CHUNK
    cfg = small_config(cpu_chunks=chunks)
    a_tokens, a_kv = make_tokens(TOKENS, 45007), make_kv(TOKENS, 7)
    b_tokens, b_kv = make_tokens(TOKENS, 45008), make_kv(TOKENS, 8)
    out = copies.mark(torch.zeros_like(a_kv))
    with Engine(cfg, SMALL_LAYOUT, model_name="fence", copies=copies) as engine:
        assert engine.store(a_tokens, a_kv) == chunks
        engine.lookup(a_tokens + [1], "a")
        assert engine.retrieve_into(a_tokens + [1], "a", out) == TOKENS
        engine.end_request("a")
        assert engine.store(b_tokens, b_kv) == chunks  # every page of A, written again
        copies.drain()
        assert engine.check_invariants() == []
    assert torch.equal(out, a_kv) is not lying


# -- the default engine -----------------------------------------------------------------


def test_host_tensors_have_landed_when_their_batch_closes() -> None:
    src, dst = torch.arange(8.0), torch.zeros(8)
    batch = DeviceCopies().begin(src, Direction.STORE)
    batch.copy(dst, src)
    assert batch.close() is LANDED  # made on the host copy threads, all done at close
    assert torch.equal(dst, src)


def test_a_host_load_closed_without_ordering_the_caller_has_landed() -> None:
    """``close(order_caller=False)`` on a host: copied at once, and its fence orders no
    stream (there is none)."""
    src, dst = torch.arange(8.0), torch.zeros(8)
    batch = DeviceCopies().begin(dst, Direction.LOAD)
    batch.copy(dst, src)
    landed = batch.close(order_caller=False)
    assert landed is LANDED and torch.equal(dst, src)
    landed.order_current_stream()  # a no-op
    assert landed.done()


def busy_device_kv(want: torch.Tensor) -> torch.Tensor:
    """``want`` on the GPU, its bytes arriving only after a long queue of kernels on the
    current stream: a copy that does not wait for that stream reads zeros."""
    kv = torch.zeros_like(want, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy
        busy /= busy.norm()
    kv.add_(want.cuda())
    return kv


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier", ["disk", "cpu_codec"])
def test_a_store_behind_a_busy_stream_reads_back_exact(tmp_path: Path, tier: str) -> None:
    """On a GPU: queue a long kernel, store, read back through a host reader of the page."""
    tokens, want = make_tokens(TOKENS, 45009), make_kv(TOKENS, 9)
    if tier == "disk":
        cfg = small_config(local_disk=str(tmp_path), max_local_disk_size="1MiB", cpu_chunks=8)
    else:
        cfg = small_config(cpu_chunks=16, cpu_codec="lossless", cpu_codec_staging=f"{PAGE}B")
    with Engine(cfg, SMALL_LAYOUT, model_name="fence") as engine:
        engine.store(tokens, busy_device_kv(want))
        if tier == "cpu_codec":
            with engine.request("r"):
                engine.lookup(tokens + [1], "r")
                served = engine.retrieve(tokens + [1], "r")
            assert served_right(want, served)
            return
    with Engine(cfg, SMALL_LAYOUT, model_name="fence") as engine, engine.request("r"):
        engine.lookup(tokens + [1], "r")
        served = engine.retrieve(tokens + [1], "r")
    assert served_right(want, served)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_load_into_the_gpu_is_exact_when_its_request_ends_at_once() -> None:
    chunks = TOKENS // SMALL_CHUNK
    cfg = small_config(cpu_chunks=chunks)
    a_tokens, a_kv = make_tokens(TOKENS, 45010), make_kv(TOKENS, 10)
    b_tokens, b_kv = make_tokens(TOKENS, 45011), make_kv(TOKENS, 11)
    out = torch.zeros_like(a_kv, device="cuda")
    with Engine(cfg, SMALL_LAYOUT, model_name="fence") as engine:
        engine.store(a_tokens, a_kv)
        engine.lookup(a_tokens + [1], "a")
        busy_device_kv(a_kv)  # the load queues behind this
        assert engine.retrieve_into(a_tokens + [1], "a", out) == TOKENS
        engine.end_request("a")
        engine.store(b_tokens, b_kv)  # A's pages, written again
        assert torch.equal(out.cpu(), a_kv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_load_closed_without_ordering_the_caller_orders_it_when_asked() -> None:
    """A layer-wise load's fence: closed without ordering the model's stream, then ordered
    before the compute that reads it. That compute (a clone) sees every byte, though the
    copy was queued behind a long kernel on the caller's stream."""
    want = make_kv(TOKENS, 12)
    src = want.pin_memory()
    out = torch.zeros_like(want, device="cuda")
    busy_device_kv(want)  # the copy waits for this first
    batch = DeviceCopies().begin(out, Direction.LOAD)
    batch.copy(out, src)
    landed = batch.close(order_caller=False)
    landed.order_current_stream()
    seen = out.clone()  # on the current stream, after the copy
    assert torch.equal(seen.cpu(), want)
    assert landed.done()
