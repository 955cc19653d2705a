from __future__ import annotations

import pytest
import torch

from kvtier.errors import InputError
from kvtier.layout import KVLayout
from kvtier.quality.roundtrip import through_codec
from kvtier.storage.codecs import IDENTITY
from tests.quality.codecs import Int8Absmax

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_identity_round_trip_is_exact_with_a_partial_last_chunk() -> None:
    kv = torch.randn(LAYOUT.kv_shape(37), generator=torch.Generator().manual_seed(0))
    trip = through_codec(kv, LAYOUT, IDENTITY, chunk_size=16)
    assert torch.equal(trip.kv, kv)
    assert trip.payload_bytes == trip.stored_bytes == LAYOUT.payload_bytes(37)


def test_a_bf16_layout_stores_bf16_pages() -> None:
    kv = torch.randn(LAYOUT.kv_shape(16), generator=torch.Generator().manual_seed(0))
    bf16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    trip = through_codec(kv, bf16, IDENTITY, chunk_size=16)
    assert trip.kv.dtype == torch.float32
    assert torch.equal(trip.kv, kv.to(torch.bfloat16).float())
    assert trip.stored_bytes == bf16.payload_bytes(16)


def test_a_lossy_codec_changes_the_kv_a_little() -> None:
    kv = torch.randn(LAYOUT.kv_shape(20), generator=torch.Generator().manual_seed(0))
    trip = through_codec(kv, LAYOUT, Int8Absmax(), chunk_size=8)
    assert 0 < (trip.kv - kv).abs().max() < 0.05
    assert trip.stored_bytes < trip.payload_bytes


def test_kv_of_another_shape_is_refused() -> None:
    with pytest.raises(InputError, match="does not fit"):
        through_codec(torch.zeros(2, 3, 4, 16), LAYOUT, IDENTITY, chunk_size=4)
