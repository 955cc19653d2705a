"""PrefixLister against a real S3 server (SeaweedFS): a listing makes the index what the
prefix holds (objects that are not chunks ignored), and a store that does not answer leaves
the index as it was and says so."""

from __future__ import annotations

import time
import urllib.request
from urllib.parse import quote

import pytest

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


def foreign_put(server: SeaweedFS, bucket: str, name: str, data: bytes) -> None:
    """Store ``name`` through SeaweedFS's filer (no S3 client here can name it: obstore
    refuses a control character)."""
    url = f"http://127.0.0.1:{server.filer_port}/buckets/{bucket}/{quote(name)}"
    urllib.request.urlopen(urllib.request.Request(url, data=data, method="PUT")).close()


def test_a_name_no_client_can_parse_is_skipped_not_fatal(
    seaweedfs: SeaweedFS, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One foreign object whose name holds a newline used to fail every listing of the
    prefix (obstore parses every name of a page): the chunks are listed, the name is
    reported once, escaped and bounded."""
    raw = raw_client(seaweedfs, bucket)
    keys = [bytes([i]) * 16 for i in range(3)]
    for key in keys:
        raw.put("kv/fp/" + key.hex(), b"record")
    foreign_put(seaweedfs, bucket, "kv/fp/evil\nname" + "x" * 200, b"x")
    index = ChunkIndex()
    skipped: list[list[str]] = []
    failed: list[BaseException] = []
    lister = PrefixLister(raw, "kv/fp/", index, 0.0, lambda: None, failed.append)
    lister._on_skipped = skipped.append
    assert lister.refresh() is True, failed
    assert index.contains(keys) == [True] * 3 and index.totals() == (18, 3)
    assert [len(names) for names in skipped] == [1] and skipped[0][0].startswith("kv/fp/evil\n")
    line = next(r.getMessage() for r in caplog.records if "no client can name" in r.getMessage())
    assert "evil\\nname" in line and "\n" not in line and len(line) < 400


def test_an_object_too_large_for_a_record_is_not_indexed(seaweedfs: SeaweedFS, bucket: str) -> None:
    raw = raw_client(seaweedfs, bucket)
    small, large = bytes(range(16)), bytes(range(1, 17))
    raw.put("kv/fp/" + small.hex(), b"r" * 100)
    raw.put("kv/fp/" + large.hex(), b"r" * 101)
    index = ChunkIndex()
    lister = PrefixLister(raw, "kv/fp/", index, 0.0, lambda: None, print, max_size=100)
    assert lister.refresh() is True
    assert index.contains([small, large]) == [True, False]


def test_the_lister_thread_outlives_an_error_it_did_not_expect(
    seaweedfs: SeaweedFS, bucket: str
) -> None:
    """A prefix obstore refuses (a '..' segment; config load refuses it now) raised a
    ValueError that ended the thread, and open() waited its whole timeout."""
    raw = raw_client(seaweedfs, bucket)
    failed: list[BaseException] = []
    lister = PrefixLister(raw, "kv/../fp/", ChunkIndex(), 0.05, lambda: None, failed.append)
    try:
        assert lister.start(5.0) is True  # the first listing ended (failed), no wait
        time.sleep(0.3)
        assert lister._thread is not None and lister._thread.is_alive()
        assert len(failed) >= 2  # and it went on listing
    finally:
        lister.stop(5.0)
