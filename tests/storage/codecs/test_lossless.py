"""The lossless codec (blosc2 byte shuffle + zstd): exact, smaller on KV, and a frame it did
not write, or one for another page size, is a miss (CorruptRecord), never a short page."""

from __future__ import annotations

import pytest
import torch

from kvtier.bench.codec_data import synthetic_kv
from kvtier.errors import CorruptRecord
from kvtier.layout import KVLayout
from kvtier.storage.codecs import LOSSLESS, codec_by_id, codec_by_name

LAYOUT = KVLayout(4, 4, 64, torch.bfloat16)


def page(layout: KVLayout = LAYOUT, tokens: int = 64) -> torch.Tensor:
    return synthetic_kv(layout, tokens).reshape(-1).view(torch.uint8)


def test_registered_as_id_1_and_keeps_keys() -> None:
    assert codec_by_id(1) is LOSSLESS and codec_by_name("lossless") is LOSSLESS
    assert LOSSLESS.lossless and not LOSSLESS.is_identity


@pytest.mark.parametrize(("dtype", "at_least"), [(torch.bfloat16, 1.3), (torch.float32, 1.1)])
def test_kv_shrinks_by_the_measured_ratio_and_comes_back_exactly(
    dtype: torch.dtype, at_least: float
) -> None:
    layout = KVLayout(4, 4, 64, dtype)
    data = page(layout)
    stored = bytes(LOSSLESS.encode(memoryview(data.numpy()), layout))
    assert data.numel() / len(stored) >= at_least  # docs/codecs.md: 1.44 bf16, 1.18 fp32
    out = bytearray(data.numel())
    assert LOSSLESS.decode(memoryview(stored), memoryview(out), layout) == data.numel()
    assert bytes(out) == data.numpy().tobytes()


def test_a_frame_for_another_page_size_is_refused() -> None:
    data = page()
    stored = bytes(LOSSLESS.encode(memoryview(data.numpy()), LAYOUT))
    with pytest.raises(CorruptRecord, match="holds"):
        LOSSLESS.decode(memoryview(stored), memoryview(bytearray(data.numel() - 2)), LAYOUT)


@pytest.mark.parametrize("junk", [b"", b"x" * 15, bytes(range(256)) * 4])
def test_bytes_it_did_not_write_are_corrupt(junk: bytes) -> None:
    with pytest.raises(CorruptRecord):
        LOSSLESS.decode(memoryview(junk), memoryview(bytearray(1024)), LAYOUT)
