"""The PD receive tier: the tier contract, sizing (a ceiling in whole chunks), held keys (one
reference per request), pins (each released once, on every path)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from kvtier import Engine
from kvtier.config.channels import check_channel
from kvtier.errors import ConfigError, TransferError, TransferTimeout
from kvtier.lease import LeaseTable
from kvtier.memory.block_pool import BlockPool
from kvtier.pd.buffer import PDBuffer, TooLarge
from kvtier.pd.channels.base import checksum
from kvtier.pd.channels.tcp import TcpReceiver
from kvtier.pd.reservation import Reservation
from kvtier.storage.base import PutJob, PutOutcome, PutResult
from tests.conftest import SMALL_LAYOUT, make_tokens, small_config
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    PAGE_BYTES,
    TOKEN_BYTES,
    Outcomes,
    TierContract,
    payload,
    random_key,
)


class PrefillerFedBuffer(PDBuffer):
    """The contract's puts arrive the way a prefiller's chunks do: reserve, write the page,
    publish. Each put's reservation stands for the decoder request holding the chunk;
    remove and clear end it, as the request's end would."""

    def __init__(self) -> None:
        super().__init__(16, PAGE_BYTES, TOKEN_BYTES, TcpReceiver())
        self.held: dict[bytes, Reservation] = {}

    def put(self, job: PutJob) -> None:
        key, payload, num_tokens, on_done = job.key, job.payload, job.num_tokens, job.on_done
        if self.contains([key]) == [True]:
            on_done(PutResult(key, PutOutcome.EXISTS))
            return
        try:  # a reservation of the put's tenant (its share, under tenant_quotas)
            res, _ = self.reserve(
                f"contract-{key.hex()}", [key], [num_tokens], timeout=0.0, tenant=job.tenant
            )
        except TransferError as exc:  # buffer full, or the tenant at its share
            on_done(PutResult(key, PutOutcome.DROPPED, str(exc)))
            return
        (page,) = res.new
        self.page_view(page, payload.numel()).copy_(payload)
        assert self.publish(res, page, checksum(payload))
        self.held[key] = res
        on_done(PutResult(key, PutOutcome.STORED))

    def remove(self, key: bytes) -> bool:
        removed = super().remove(key)
        self._end_unlisted()
        return removed

    def clear(self) -> int:
        dropped = super().clear()
        self._end_unlisted()
        return dropped

    def _end_unlisted(self) -> None:
        for key in [k for k in self.held if self.contains([k]) == [False]]:
            self.held.pop(key).release()


class TestPDBufferContract(TierContract):
    @pytest.fixture
    def tier(self) -> Iterator[PDBuffer]:
        tier = PrefillerFedBuffer()
        tier.open()
        yield tier
        tier.clear()
        assert tier.pool.free_pages == 16
        tier.close()


@pytest.fixture
def tier() -> Iterator[PDBuffer]:
    tier = PDBuffer(3, PAGE_BYTES, TOKEN_BYTES, TcpReceiver())
    tier.open()
    yield tier
    tier.close()


def fill(tier: PDBuffer, res: Reservation, seed: int = 0) -> None:
    """What a sender does: write every new page of the reservation, then publish it."""
    for page in res.new:
        data = payload(CONTRACT_CHUNK, seed + page)
        tier.page_view(page, data.numel()).copy_(data)
        assert tier.publish(res, page, checksum(data))


# -- pd_buffer_size is a ceiling rounded down to whole chunks --------------------------------
def pd_engine(buffer: object, **kw: object) -> Engine:
    cfg = small_config(enable_pd=True, pd_role="receiver", pd_buffer_size=buffer, **kw)
    return Engine(cfg, SMALL_LAYOUT, model_name="m")


@pytest.mark.parametrize(
    "size, pages", [("10000B", 2), ("12288B", 3), ("4096B", 1), ("1MiB", 256), ("16383B", 3)]
)
def test_buffer_is_rounded_down_to_whole_chunks(size: str, pages: int) -> None:
    assert PAGE_BYTES == 4096
    with pd_engine(size) as engine:
        tier = engine.tier("pd")
        assert isinstance(tier, PDBuffer)
        assert tier.num_pages == pages
        assert tier.pool.buffer.numel() == pages * 4096
        assert tier.usage().capacity_bytes == pages * 4096


def test_the_cut_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.memory.block_pool"), pd_engine("10000B"):
        pass
    lines = [r.getMessage() for r in caplog.records if "pd_buffer_size" in r.getMessage()]
    assert lines == [
        "pd_buffer_size: asked 10000 bytes, using 8192 bytes (2 chunks of 4096 bytes; "
        "1808 bytes unused)"
    ]


def test_below_one_chunk_is_a_config_error() -> None:
    engine = pd_engine("4095B")  # the layout is known here; tiers are built at open
    with pytest.raises(ConfigError) as info:
        engine.open()
    assert info.value.key == "pd_buffer_size"


def test_nixl_without_the_package_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvtier.config.channels.nixl_installed", lambda: False)
    with pytest.raises(ConfigError, match="nixl") as info:
        check_channel("nixl")
    assert info.value.key == "transfer_channel"


# -- a held key takes one reference for the request, given back with it ----------------------
def test_held_keys_take_exactly_one_reference_per_request(tier: PDBuffer) -> None:
    k1, k2, k3 = random_key(), random_key(), random_key()
    a, held_a = tier.reserve("a", [k1, k2], [16, 16], timeout=1.0)
    fill(tier, a)
    b, held_b = tier.reserve("b", [k1, k2, k3], [16, 16, 16], timeout=1.0)
    assert held_a == [] and held_b == [0, 1]
    assert list(b.new.values()) == [k3]  # only k3 is sent again
    shared = [p for p in a.pages]
    assert [tier.pool.refcount(p) for p in shared] == [2, 2]  # a's and b's: nothing else
    a.release()
    assert [tier.pool.refcount(p) for p in shared] == [1, 1]
    b.release()
    assert tier.pool.free_pages == 3
    assert tier.contains([k1, k2, k3]) == [False, False, False]


def test_shared_prefixes_never_exhaust_the_buffer(tier: PDBuffer) -> None:
    """LMCache #2847's reproduction: requests sharing a prefix, overlapping in time. With a
    stray reference per held key, this 3-page buffer would run dry within a few requests."""
    prefix = [random_key()]
    previous: Reservation | None = None
    for i in range(50):
        res, held = tier.reserve(f"r{i}", [*prefix, random_key()], [16, 16], timeout=0.2)
        fill(tier, res, seed=i)
        assert held == ([] if previous is None else [0])
        if previous is not None:
            previous.release()
        previous = res
    assert previous is not None
    previous.release()
    assert tier.pool.free_pages == 3
    assert tier.check_invariants() == []


# -- every pin released once, on every path -------------------------------------------------
def test_abort_then_request_end_releases_once(tier: PDBuffer) -> None:
    leases = LeaseTable(BlockPool(1, 64))
    res, _ = tier.reserve("r", [random_key(), random_key()], [16, 16], timeout=1.0)
    leases.open("r").take_hold(res)
    res.release()  # the abort path (sender died, Abort message, timeout)
    assert tier.pool.free_pages == 3
    assert leases.end("r")  # the request ends: the lease's release is a no-op now
    assert not leases.end("r")
    assert tier.pool.refcounts() == [0, 0, 0]


def test_decoder_pins_are_released_by_end_request() -> None:
    from kvtier.pd.channels.base import checksum as xxh

    with pd_engine("12288B", save_unfull_chunk=True) as engine:
        tier = engine.tier("pd")
        assert isinstance(tier, PDBuffer)
        tokens = make_tokens(40, 3)
        spans = engine.keychain.keys(tokens, include_partial=True)
        res, _ = tier.reserve("r", [s.key for s in spans], [s.num_tokens for s in spans], 1.0)
        engine.receiver_host().attach_hold("r", res)
        kv = torch.randn(SMALL_LAYOUT.kv_shape(40))
        for page, span in zip(res.new, spans, strict=True):
            chunk = kv[:, :, span.start : span.end, :].contiguous().view(-1).view(torch.uint8)
            tier.page_view(page, chunk.numel()).copy_(chunk)
            assert tier.publish(res, page, xxh(chunk))
        assert engine.lookup(tokens, "r").tokens == 40
        assert torch.equal(engine.retrieve(tokens, "r"), kv)
        assert engine.end_request("r")
        assert not engine.end_request("r")
        assert tier.pool.free_pages == 3
        assert engine.leaks() == []
        assert engine.check_invariants() == []


# -- backpressure and bad chunks -------------------------------------------------------------
def test_a_full_buffer_times_out(tier: PDBuffer) -> None:
    first, _ = tier.reserve("a", [random_key() for _ in range(3)], [16] * 3, timeout=1.0)
    with pytest.raises(TransferTimeout, match="no room"):
        tier.reserve("b", [random_key()], [16], timeout=0.05)
    first.release()
    assert tier.pool.free_pages == 3


def test_a_waiting_reservation_wakes_when_room_returns(tier: PDBuffer) -> None:
    first, _ = tier.reserve("a", [random_key() for _ in range(3)], [16] * 3, timeout=1.0)
    got: list[Reservation] = []
    waiter = threading.Thread(
        target=lambda: got.append(tier.reserve("b", [random_key()], [16], timeout=10.0)[0])
    )
    waiter.start()
    first.release()
    waiter.join(10.0)
    assert len(got) == 1 and len(got[0].pages) == 1
    got[0].release()
    assert tier.pool.free_pages == 3


def test_a_request_larger_than_the_buffer_fails_at_once(tier: PDBuffer) -> None:
    with pytest.raises(TooLarge, match="needs 4 chunks"):
        tier.reserve("big", [random_key() for _ in range(4)], [16] * 4, timeout=30.0)
    assert tier.pool.free_pages == 3


def test_a_bad_checksum_is_dropped_not_published(tier: PDBuffer) -> None:
    key = random_key()
    res, _ = tier.reserve("r", [key], [16], timeout=1.0)
    (page,) = res.new
    tier.page_view(page, PAGE_BYTES).copy_(payload(16, 1))
    assert not tier.publish(res, page, 12345)
    assert tier.contains([key]) == [False]
    assert tier.counters.corrupt == 1
    res.release()
    assert tier.pool.free_pages == 3 and tier.check_invariants() == []


def test_a_page_changed_after_publish_is_a_miss(tier: PDBuffer) -> None:
    key = random_key()
    res, _ = tier.reserve("r", [key], [16], timeout=1.0)
    fill(tier, res)
    (page,) = res.new
    tier.page_view(page, 4).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert tier.get_into(key, torch.empty(PAGE_BYTES, dtype=torch.uint8)) is None
    assert tier.counters.corrupt == 1 and tier.contains([key]) == [False]
    res.release()
    assert tier.pool.free_pages == 3


def test_decoder_stores_do_not_fill_the_receive_buffer(tier: PDBuffer) -> None:
    done = Outcomes()
    tier.put(PutJob(os.urandom(16), payload(16, 0), 16, "", done))
    assert done.wait(1)[0].outcome is PutOutcome.DROPPED
    assert tier.pool.free_pages == 3
