"""PrefixLister against a real S3 server (SeaweedFS): a listing makes the index what the
prefix holds (objects that are not chunks ignored), and a store that does not answer leaves
the index as it was and says so."""

from __future__ import annotations

from kvtier.bench.seaweedfs import SeaweedFS
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.index import ChunkIndex
from kvtier.storage.s3.listing import PrefixLister
from tests.storage.s3.test_tier import raw_client


def test_a_listing_holds_the_chunks_under_the_prefix_and_nothing_else(
    seaweedfs: SeaweedFS, bucket: str
) -> None:
    raw = raw_client(seaweedfs, bucket)
    key = bytes(range(16))
    raw.put("kv/fp/" + key.hex(), b"record")
    raw.put("kv/fp/not-a-chunk", b"x")  # a foreign file under the prefix
    raw.put("kv/fp.tenants/t/" + key.hex(), b"")  # a marker: another prefix
    index = ChunkIndex()
    listed: list[int] = []
    failed: list[BaseException] = []
    lister = PrefixLister(raw, "kv/fp/", index, 0.0, lambda: listed.append(1), failed.append)
    assert lister.refresh() is True
    assert index.contains([key]) == [True] and index.totals() == (6, 1)
    assert listed == [1] and failed == []


def test_a_store_that_does_not_answer_leaves_the_index(seaweedfs: SeaweedFS, bucket: str) -> None:
    raw = S3Client(seaweedfs.endpoint, bucket, seaweedfs.credentials_dict(), timeout_s=0.5)
    index = ChunkIndex()
    index.add(b"k" * 16, 10)
    failed: list[BaseException] = []
    lister = PrefixLister(raw, "kv/fp/", index, 0.0, lambda: None, failed.append)
    seaweedfs.pause()
    try:
        assert lister.refresh() is False
    finally:
        seaweedfs.resume()
    assert index.contains([b"k" * 16]) == [True] and len(failed) == 1
