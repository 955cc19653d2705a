"""fp8 and int8: exact stored sizes (scales included), the scaling rules the docs state
(measured here on the synthetic KV), state layers byte for byte, MLA latents, and stored
bytes of the wrong length refused."""

from __future__ import annotations

import pytest
import torch

from kvtier.bench.codec_data import synthetic_kv
from kvtier.errors import CorruptRecord
from kvtier.layout import GroupKind, KVGroup, KVLayout
from kvtier.storage.codecs import FP8, INT8, QuantizedCodec, codec_by_id

LAYOUT = KVLayout(4, 4, 128, torch.bfloat16)
TOKENS = 64


def round_trip(codec: QuantizedCodec, layout: KVLayout, kv: torch.Tensor) -> torch.Tensor:
    page = kv.reshape(-1).view(torch.uint8)
    stored = memoryview(codec.encode(memoryview(page.numpy()), layout)).cast("B")
    assert stored.nbytes == codec.stored_bytes(layout, kv.shape[2])
    out = torch.empty_like(page)
    assert codec.decode(stored, memoryview(out.numpy()), layout) == page.numel()
    return out.view(layout.dtype).view(kv.shape)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_ids_2_and_3_are_lossy() -> None:
    assert codec_by_id(2) is FP8 and codec_by_id(3) is INT8
    assert not FP8.lossless and not INT8.lossless


@pytest.mark.parametrize("codec", [FP8, INT8], ids=["fp8", "int8"])
def test_stored_size_is_one_byte_per_element_plus_f32_scales(codec: QuantizedCodec) -> None:
    layout, n = LAYOUT, TOKENS
    elements = 2 * 4 * n * layout.hidden
    value_scales = 4 * n * 4  # layers x tokens x heads
    key_scales = 4 * layout.hidden if codec.keys_per_channel else value_scales
    assert codec.stored_bytes(layout, n) == 4 + elements + 4 * (key_scales + value_scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("codec", "bound"), [(FP8, 0.03), (INT8, 0.008)], ids=["fp8", "int8"])
def test_decoded_kv_is_the_layout_dtype_within_the_measured_error(
    codec: QuantizedCodec, bound: float, dtype: torch.dtype
) -> None:
    layout = KVLayout(4, 4, 128, dtype)
    kv = synthetic_kv(layout, TOKENS)
    back = round_trip(codec, layout, kv)
    assert back.dtype == dtype
    assert rel(back[0], kv[0]) < bound and rel(back[1], kv[1]) < bound


def keys_error(codec: QuantizedCodec, kv: torch.Tensor, per_channel: bool) -> float:
    """The key error of one scaling rule: per channel (over the chunk's tokens) or per token
    and head."""
    keys = kv[0].float()
    if per_channel:
        scale = codec._scale(keys.abs().amax(1)).unsqueeze(1)
    else:
        split = keys.unflatten(-1, (LAYOUT.num_kv_heads, LAYOUT.head_dim))
        scale = codec._scale(split.abs().amax(-1)).repeat_interleave(LAYOUT.head_dim, -1)
    back = codec._dequantize(codec._quantize(keys / scale)) * codec.unit * scale
    return rel(back, keys)


@pytest.mark.parametrize("codec", [FP8, INT8], ids=["fp8", "int8"])
def test_each_codec_scales_keys_the_way_that_measured_more_accurate(
    codec: QuantizedCodec,
) -> None:
    kv = synthetic_kv(LAYOUT, TOKENS)
    channel, token = keys_error(codec, kv, True), keys_error(codec, kv, False)
    assert codec.keys_per_channel == (channel < token)
    if codec.keys_per_channel:  # int8: per channel halves the error
        assert channel < 0.6 * token


@pytest.mark.parametrize("codec", [FP8, INT8], ids=["fp8", "int8"])
def test_state_layers_come_back_byte_for_byte_in_both_page_forms(codec: QuantizedCodec) -> None:
    state = KVGroup(GroupKind.STATE, (3,), detail="t")
    plain = KVLayout(4, 2, 8, torch.bfloat16, groups=(KVGroup(GroupKind.FULL, (0, 1, 2)), state))
    trimmed = KVLayout(
        4,
        2,
        8,
        torch.bfloat16,
        groups=(
            KVGroup(GroupKind.SLIDING, (0, 2), 8, keep=8),
            KVGroup(GroupKind.FULL, (1,)),
            state,
        ),
    )
    for layout in (plain, trimmed):
        kv = synthetic_kv(layout, 16)
        kv[:, 3] = torch.randint(0, 256, kv[:, 3].shape, dtype=torch.int16).to(torch.bfloat16)
        page = torch.empty(layout.payload_bytes(16), dtype=torch.uint8)
        layout.pack(kv, page)
        stored = memoryview(codec.encode(memoryview(page.numpy()), layout)).cast("B")
        out = torch.empty_like(page)
        codec.decode(stored, memoryview(out.numpy()), layout)
        got, want = torch.zeros_like(kv), torch.zeros_like(kv)
        layout.unpack(out, got)
        layout.unpack(page, want)
        assert torch.equal(got[:, 3].view(torch.int16), want[:, 3].view(torch.int16))
        assert rel(got[:, :3], want[:, :3]) < 0.03


@pytest.mark.parametrize("codec", [FP8, INT8], ids=["fp8", "int8"])
def test_an_mla_latent_is_scaled_per_token(codec: QuantizedCodec) -> None:
    layout = KVLayout(4, 1, 576, torch.bfloat16, planes=1)
    kv = synthetic_kv(layout, 32)
    assert codec.stored_bytes(layout, 32) == 4 + 4 * 32 * 576 + 4 * 4 * 32
    assert rel(round_trip(codec, layout, kv), kv) < 0.03


@pytest.mark.parametrize("codec", [FP8, INT8], ids=["fp8", "int8"])
def test_zero_kv_round_trips_to_zeros(codec: QuantizedCodec) -> None:
    kv = torch.zeros(LAYOUT.kv_shape(8), dtype=LAYOUT.dtype)
    assert not bool(round_trip(codec, LAYOUT, kv).any())


@pytest.mark.parametrize("codec", [FP8, INT8], ids=["fp8", "int8"])
def test_stored_bytes_of_another_length_or_token_count_are_corrupt(codec: QuantizedCodec) -> None:
    kv = synthetic_kv(LAYOUT, 8)
    page = kv.reshape(-1).view(torch.uint8)
    stored = bytes(memoryview(codec.encode(memoryview(page.numpy()), LAYOUT)).cast("B"))
    out = memoryview(bytearray(page.numel()))
    for bad in (stored[:-1], stored + b"\0", b"\x07\0\0\0" + stored[4:], b"\0\0"):
        with pytest.raises(CorruptRecord):
            codec.decode(memoryview(bad), out, LAYOUT)
    with pytest.raises(CorruptRecord):  # a page size no token count has
        codec.decode(memoryview(stored), memoryview(bytearray(page.numel() - 1)), LAYOUT)
