"""Shared pieces of the disk tier tests: a tier on a temporary directory, and its files."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.fingerprint import Fingerprint
from kvtier.storage.codecs import IDENTITY, PayloadCodec
from kvtier.storage.disk.options import DiskOptions
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.records import HEADER_SIZE
from tests.storage.tier_contract import CONTRACT_CHUNK, CONTRACT_LAYOUT, PAGE_BYTES

FP = Fingerprint("test-model", CONTRACT_LAYOUT, CONTRACT_CHUNK)
RECORD_BYTES = HEADER_SIZE + PAGE_BYTES


def make_tier(
    path: Path,
    *,
    capacity_records: int = 64,
    inflight_records: int = 64,
    threads: int = 2,
    fingerprint: Fingerprint = FP,
    codec: PayloadCodec = IDENTITY,
) -> DiskTier:
    options = DiskOptions(
        str(path), capacity_records * RECORD_BYTES, threads, inflight_records * RECORD_BYTES
    )
    return DiskTier(options, CONTRACT_LAYOUT, fingerprint, codec)


def chunk_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".kvc"))


def temp_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".tmp"))
