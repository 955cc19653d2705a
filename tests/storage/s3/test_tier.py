"""The s3 tier against a real S3 server (SeaweedFS, started once per session; a bucket per
test): the tier contract, the record in the object, the index that answers lookups without
a request, other writers, corrupt and deleted objects, and a store that stalls or dies."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.bench.seaweedfs import SeaweedFS
from kvtier.fingerprint import Fingerprint
from kvtier.storage import records
from kvtier.storage.base import Membership, PutJob, PutOutcome, ReadAbandoned
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.options import S3Options, parse_s3_url
from kvtier.storage.s3.tier import RETRY_AFTER_S, S3Tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    Outcomes,
    TierContract,
    payload,
    put_and_wait,
    random_key,
)

FINGERPRINT = Fingerprint("contract-model", CONTRACT_LAYOUT, CONTRACT_CHUNK)
TIMEOUT_S = 2.0

OpenTier = Callable[..., S3Tier]


def options(server: SeaweedFS, bucket: str, **overrides: object) -> S3Options:
    values: dict[str, object] = {
        "location": parse_s3_url(f"s3://{bucket}/kv"),
        "endpoint": server.endpoint,
        "region": server.credentials.region,
        "credentials": server.credentials_dict(),
        "timeout_s": TIMEOUT_S,
        "list_interval_s": 0.0,  # tests call refresh() themselves
        **overrides,
    }
    return S3Options(**values)  # type: ignore[arg-type]


@pytest.fixture
def open_tier(seaweedfs: SeaweedFS, bucket: str) -> Iterator[OpenTier]:
    opened: list[S3Tier] = []

    def open_one(**overrides: object) -> S3Tier:
        tier = S3Tier(options(seaweedfs, bucket, **overrides), CONTRACT_LAYOUT, FINGERPRINT)
        tier.open()
        opened.append(tier)
        return tier

    yield open_one
    seaweedfs.resume()
    for tier in opened:
        tier.close()


class TestS3TierContract(TierContract):
    @pytest.fixture
    def tier(self, open_tier: OpenTier) -> S3Tier:
        return open_tier()


@pytest.fixture
def tier(open_tier: OpenTier) -> S3Tier:
    return open_tier()


def raw_client(server: SeaweedFS, bucket: str) -> S3Client:
    return S3Client(server.endpoint, bucket, server.credentials_dict(), timeout_s=10.0)


def test_an_object_is_a_checksummed_record_under_the_fingerprint(
    tier: S3Tier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    key, data = random_key(), payload(CONTRACT_CHUNK, 7)
    put_and_wait(tier, key, data, CONTRACT_CHUNK)
    name = f"kv/{FINGERPRINT.hex()}/{key.hex()}"
    assert tier.store.name_of(key) == name
    stored = raw_client(seaweedfs, bucket).get(name)
    assert stored is not None
    assert bytes(stored) == records.encode_record(key, FINGERPRINT, CONTRACT_CHUNK, data)


def test_a_corrupt_object_is_a_miss_deleted_and_counted(
    tier: S3Tier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    key, data = random_key(), payload(CONTRACT_CHUNK, 8)
    put_and_wait(tier, key, data, CONTRACT_CHUNK)
    raw = raw_client(seaweedfs, bucket)
    record = bytearray(records.encode_record(key, FINGERPRINT, CONTRACT_CHUNK, data))
    record[-1] ^= 0xFF  # one payload bit flipped on the server
    raw.put(tier.store.name_of(key), bytes(record))
    removed: list[list[bytes]] = []
    tier.add_membership_listener(
        lambda change, keys: removed.append(list(keys)) if change is Membership.REMOVED else None
    )
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert tier.get_into(key, out) is None
    assert tier.counters.corrupt == 1 and tier.contains([key]) == [False]
    assert raw.get(tier.store.name_of(key)) is None  # deleted
    assert removed == [[key]] and "checksum" in (tier.corruption(key) or "")


def test_a_record_of_another_chunk_under_this_name_is_a_miss(
    tier: S3Tier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    key, other = random_key(), random_key()
    put_and_wait(tier, key, payload(CONTRACT_CHUNK, 9), CONTRACT_CHUNK)
    wrong = records.encode_record(other, FINGERPRINT, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 9))
    raw_client(seaweedfs, bucket).put(tier.store.name_of(key), wrong)
    assert tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None
    assert tier.counters.corrupt == 1


def test_lookups_answer_from_the_index_while_the_store_is_stalled(
    tier: S3Tier, seaweedfs: SeaweedFS
) -> None:
    """512 chunks (a 128k-token prompt of 256-token chunks) looked up with the server stopped
    (SIGSTOP): answered at once, so no request was sent."""
    keys = [random_key() for _ in range(512)]
    put_and_wait(tier, keys[0], payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
    seaweedfs.pause()
    try:
        start = time.monotonic()
        found = tier.contains(keys)
        took = time.monotonic() - start
    finally:
        seaweedfs.resume()
    assert found == [True] + [False] * 511
    assert took < TIMEOUT_S / 4, f"contains took {took:.3f}s: it waited on the server"


def test_a_tier_opened_later_lists_what_the_prefix_holds(open_tier: OpenTier) -> None:
    first = open_tier()
    keys = [random_key() for _ in range(3)]
    for i, key in enumerate(keys):
        put_and_wait(first, key, payload(CONTRACT_CHUNK, 20 + i), CONTRACT_CHUNK)
    second = open_tier()  # a restarted engine: its index comes from the listing at open
    assert second.contains(keys) == [True, True, True]
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert second.get_into(keys[1], out) == CONTRACT_CHUNK
    assert torch.equal(out, payload(CONTRACT_CHUNK, 21))
    assert second.usage().entries == 3 and second.counters.listings == 1


def test_another_writers_chunk_appears_at_the_next_refresh(open_tier: OpenTier) -> None:
    reader, writer = open_tier(), open_tier()
    key = random_key()
    put_and_wait(writer, key, payload(CONTRACT_CHUNK, 30), CONTRACT_CHUNK)
    assert reader.contains([key]) == [False]  # not listed yet: no request per lookup
    assert reader.store.refresh() is True
    assert reader.contains([key]) == [True]


def test_the_lister_refreshes_on_its_own(open_tier: OpenTier) -> None:
    reader = open_tier(list_interval_s=0.2)
    writer = open_tier()
    key = random_key()
    put_and_wait(writer, key, payload(CONTRACT_CHUNK, 31), CONTRACT_CHUNK)
    deadline = time.monotonic() + 10
    while reader.contains([key]) == [False] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader.contains([key]) == [True]


def test_a_chunk_deleted_behind_the_tiers_back_is_a_miss_that_leaves_the_index(
    tier: S3Tier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    key = random_key()
    put_and_wait(tier, key, payload(CONTRACT_CHUNK, 32), CONTRACT_CHUNK)
    raw_client(seaweedfs, bucket).delete([tier.store.name_of(key)])
    assert tier.contains([key]) == [True]
    assert tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None
    assert tier.contains([key]) == [False]


def test_a_put_of_an_indexed_key_sends_nothing(tier: S3Tier) -> None:
    key = random_key()
    put_and_wait(tier, key, payload(CONTRACT_CHUNK, 33), CONTRACT_CHUNK)
    assert put_and_wait(tier, key, payload(CONTRACT_CHUNK, 34), CONTRACT_CHUNK).outcome is (
        PutOutcome.EXISTS
    )
    assert tier.counters.stored == 1


def test_a_batch_of_reads_lands_every_chunk(tier: S3Tier) -> None:
    keys = [random_key() for _ in range(12)]
    for i, key in enumerate(keys):
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 40 + i), CONTRACT_CHUNK)
    outs = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
    assert tier.get_many_into(list(zip(keys, outs, strict=True))) == [CONTRACT_CHUNK] * 12
    for i, out in enumerate(outs):
        assert torch.equal(out, payload(CONTRACT_CHUNK, 40 + i))


def test_a_stalled_store_costs_at_most_the_timeout_then_misses_at_once(
    tier: S3Tier, seaweedfs: SeaweedFS
) -> None:
    key = random_key()
    put_and_wait(tier, key, payload(CONTRACT_CHUNK, 50), CONTRACT_CHUNK)
    seaweedfs.pause()
    try:
        start = time.monotonic()
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        try:
            assert tier.get_into(key, out) is None
        except ReadAbandoned as abandoned:
            assert list(abandoned.busy) == [0]
        assert time.monotonic() - start < TIMEOUT_S + 1.0
        # Marked down: the next read misses and a put drops without waiting.
        start = time.monotonic()
        assert tier.get_into(key, out) is None
        done = Outcomes()
        tier.put(PutJob(random_key(), payload(CONTRACT_CHUNK, 51), CONTRACT_CHUNK, "", done))
        assert done.wait(1)[0].outcome is PutOutcome.DROPPED
        assert time.monotonic() - start < 0.5
        assert tier.counters.outages == 1 and tier.usage() and tier.counters.available == 0
    finally:
        seaweedfs.resume()
    time.sleep(RETRY_AFTER_S + 0.1)
    assert tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) == CONTRACT_CHUNK


def test_a_store_that_is_down_at_open_leaves_an_empty_index(
    seaweedfs: SeaweedFS, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    opts = options(seaweedfs, bucket, endpoint="http://127.0.0.1:1")  # nothing listens there
    tier = S3Tier(opts, CONTRACT_LAYOUT, FINGERPRINT)
    start = time.monotonic()
    tier.open()
    try:
        assert time.monotonic() - start < TIMEOUT_S + 1.0
        key = random_key()
        assert tier.contains([key]) == [False]
        assert tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None
        result = put_and_wait(tier, key, payload(CONTRACT_CHUNK, 52), CONTRACT_CHUNK)
        assert result.outcome is PutOutcome.DROPPED
    finally:
        tier.close()
    # Every warning an operator acts on names the bucket and the endpoint.
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings and all(f"s3://{bucket}/" in w for w in warnings), warnings
    assert any("endpoint http://127.0.0.1:1" in w for w in warnings), warnings


def test_wrong_credentials_are_failures_that_never_show_the_secret(
    seaweedfs: SeaweedFS, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "not-the-secret-" + "x" * 20
    creds = {**seaweedfs.credentials_dict(), "secret_access_key": secret}
    tier = S3Tier(options(seaweedfs, bucket, credentials=creds), CONTRACT_LAYOUT, FINGERPRINT)
    caplog.set_level(logging.INFO)
    tier.open()
    try:
        result = put_and_wait(tier, random_key(), payload(CONTRACT_CHUNK, 53), CONTRACT_CHUNK)
        assert result.outcome is PutOutcome.FAILED
        assert "403" in result.detail or "SignatureDoesNotMatch" in result.detail, result.detail
        assert secret not in caplog.text and secret not in repr(tier.options)
        assert secret not in result.detail
    finally:
        tier.close()


def test_a_store_that_dies_costs_misses_and_is_used_again_when_it_is_back() -> None:
    """SeaweedFS stopped mid-run (connections refused: misses and drops at once, no wait),
    then started again on the same ports and data: the chunk written before is a hit."""
    server = SeaweedFS().start()
    try:
        server.create_bucket("kvtier-restart")
        tier = S3Tier(options(server, "kvtier-restart"), CONTRACT_LAYOUT, FINGERPRINT)
        tier.open()
        try:
            key, data = random_key(), payload(CONTRACT_CHUNK, 60)
            assert put_and_wait(tier, key, data, CONTRACT_CHUNK).outcome is PutOutcome.STORED
            server.stop()
            start = time.monotonic()
            out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            assert tier.get_into(key, out) is None
            result = put_and_wait(tier, random_key(), payload(CONTRACT_CHUNK, 61), CONTRACT_CHUNK)
            assert result.outcome is PutOutcome.DROPPED
            assert time.monotonic() - start < 1.0 and tier.counters.outages == 1
            server.start()
            time.sleep(RETRY_AFTER_S)
            assert tier.get_into(key, out) == CONTRACT_CHUNK
            assert torch.equal(out, data)
        finally:
            tier.close()
    finally:
        server.cleanup()


def test_an_oversized_object_under_a_chunks_name_is_a_bounded_miss(
    tier: S3Tier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    """An object far larger than a record (a 190 MiB one took +190 MiB for an 8 KiB record)
    is fetched at most one byte past a record, is a counted miss, and leaves the index;
    a listing then skips it by its size."""
    key = random_key()
    put_and_wait(tier, key, payload(CONTRACT_CHUNK, 70), CONTRACT_CHUNK)
    big = b"\0" * (tier.store.max_record_bytes * 8)
    raw = raw_client(seaweedfs, bucket)
    raw.put(tier.store.name_of(key), big)  # replaced after the tier indexed it
    got = tier.store.client.get(tier.store.name_of(key), tier.store.max_record_bytes + 1)
    assert got is not None and len(got) == tier.store.max_record_bytes + 1
    assert tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None
    assert tier.counters.oversized == 1 and tier.counters.corrupt == 0
    assert tier.contains([key]) == [False]
    assert tier.store.refresh() is True and tier.contains([key]) == [False]
    assert raw.get(tier.store.name_of(key)) is not None  # not ours to delete


def test_puts_queued_when_the_store_goes_down_drop_at_once(
    tier: S3Tier, seaweedfs: SeaweedFS
) -> None:
    """48 puts queued behind 4 writers on a stalled store: the first writes cost the
    timeout and mark the store down; the rest complete DROPPED at once (each waited the
    timeout before: flush(10) had not ended after 10 s)."""
    done = Outcomes()
    seaweedfs.pause()
    try:
        start = time.monotonic()
        for i in range(48):
            job = PutJob(random_key(), payload(CONTRACT_CHUNK, 80 + i), CONTRACT_CHUNK, "", done)
            tier.put(job)
        assert tier.flush(TIMEOUT_S * 2 + 1.0), "queued puts still waiting on a down store"
        took = time.monotonic() - start
    finally:
        seaweedfs.resume()
    results = done.wait(48)
    assert len(results) == 48 and len({r.key for r in results}) == 48  # once each
    assert {r.outcome for r in results} <= {PutOutcome.DROPPED, PutOutcome.FAILED}
    assert sum(r.outcome is PutOutcome.DROPPED for r in results) >= 44
    assert took < TIMEOUT_S * 2 + 1.0 and tier.counters.outages == 1


@pytest.mark.parametrize("change", ["cut", "longer", "empty"])
def test_a_body_not_the_length_its_header_says_is_corrupt(
    tier: S3Tier, seaweedfs: SeaweedFS, bucket: str, change: str
) -> None:
    """An object a byte short of its record, a byte over it, or empty: a corrupt miss (the
    length check the get makes before the payload's checksum), never an oversized one."""
    key, data = random_key(), payload(CONTRACT_CHUNK, 72)
    put_and_wait(tier, key, data, CONTRACT_CHUNK)
    record = records.encode_record(key, FINGERPRINT, CONTRACT_CHUNK, data)
    body = {"cut": record[:-1], "longer": record + b"\0", "empty": b""}[change]
    raw_client(seaweedfs, bucket).put(tier.store.name_of(key), body)
    assert tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None
    assert tier.counters.corrupt == 1 and tier.counters.oversized == 0
    why = tier.corruption(key) or ""
    assert ("truncated" if change == "empty" else "header says") in why
