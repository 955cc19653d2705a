from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import ConfigError, InputError, KVLayout
from kvtier.validation import (
    Prompt,
    check_buffer_start,
    check_fits_in_memory,
    check_kv,
    check_out,
    check_request_id,
    check_skip,
)

LAYOUT = KVLayout(2, 2, 8, torch.float32)
MLA = KVLayout(2, 1, 24, torch.float32, planes=1)


def test_check_kv_accepts_the_exact_shape_and_dtype() -> None:
    check_kv(torch.zeros(2, 2, 5, 16), LAYOUT, 5)
    check_kv(torch.zeros(2, 2, 9, 16)[:, :, 2:7], LAYOUT, 5)  # a strided view is fine


@pytest.mark.parametrize(
    ("kv", "fragment"),
    [
        ([1, 2], "torch.Tensor"),
        (torch.zeros(2, 2, 5, 16, dtype=torch.bfloat16), "dtype is torch.bfloat16"),
        (torch.zeros(2, 5, 16), "expected [2, num_layers=2, tokens, kv_heads*head_dim=16]"),
        (torch.zeros(2, 2, 4, 16), "holds 4 tokens but 5"),
    ],
)
def test_check_kv_names_what_is_wrong(kv: object, fragment: str) -> None:
    with pytest.raises(InputError) as info:
        check_kv(kv, LAYOUT, 5)
    assert fragment in str(info.value)


@pytest.mark.parametrize("layout", [LAYOUT, MLA], ids=["k-and-v", "mla"])
def test_check_out_takes_the_layouts_own_planes_and_room_for_the_hit(layout: KVLayout) -> None:
    check_out(torch.zeros(layout.kv_shape(9)), layout, 9)
    check_out(torch.zeros(layout.kv_shape(12))[:, :, 2:11], layout, 9)  # a strided view
    check_out(torch.zeros(layout.kv_shape(0)), layout, 0)


@pytest.mark.parametrize(
    ("out", "layout", "fragment"),
    [
        ([1, 2], LAYOUT, "got list"),
        (torch.zeros(2, 2, 9, 16, dtype=torch.bfloat16), LAYOUT, "torch.float32 tensor"),
        (torch.zeros(2, 2, 8, 16), LAYOUT, "[2, 2, >=9, 16], got (2, 2, 8, 16)"),
        (torch.zeros(1, 2, 9, 16), LAYOUT, "[2, 2, >=9, 16]"),
        (torch.zeros(2, 2, 9, 24), MLA, "[1, 2, >=9, 24], got (2, 2, 9, 24)"),
        (torch.zeros(1, 2, 9, 16), MLA, "[1, 2, >=9, 24]"),
        (torch.zeros(2, 9, 24), MLA, "[1, 2, >=9, 24]"),
        (torch.zeros(1, 2, 9, 24, device="meta"), MLA, "dense"),
    ],
)
def test_check_out_names_the_buffer_the_layout_wants(
    out: object, layout: KVLayout, fragment: str
) -> None:
    with pytest.raises(InputError) as info:
        check_out(out, layout, 9)
    assert fragment in str(info.value)


@pytest.mark.parametrize("bad", ["", None, 7, b"r"])
def test_check_request_id(bad: object) -> None:
    with pytest.raises(InputError, match="non-empty string"):
        check_request_id(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_check_skip(bad: object) -> None:
    with pytest.raises(InputError, match="skip_leading_tokens"):
        check_skip(bad)


def test_check_fits_in_memory() -> None:
    check_fits_in_memory("max_local_cpu_size", 1 << 20)
    with pytest.raises(ConfigError, match="machine's memory"):
        check_fits_in_memory("max_local_cpu_size", 1 << 60)


def _prompt(skip: int) -> Prompt:
    return Prompt(np.arange(64, dtype=np.int32), skip)


@pytest.mark.parametrize("name", ["kv_start", "out_start"])
@pytest.mark.parametrize(
    ("value", "kind"),
    # Each would pass the range rule (a chunk start at or before the skip of 32) or be
    # refused by it only by chance: the type rule must be what refuses them.
    [(16.0, "float"), (0.0, "float"), (True, "bool"), (False, "bool")],
)
def test_a_buffer_start_that_is_not_an_int_is_refused_by_the_type_rule(
    name: str, value: object, kind: str
) -> None:
    with pytest.raises(InputError) as info:
        check_buffer_start(name, value, _prompt(32), 16)
    message = str(info.value)
    assert message.startswith(f"{name} is {value!r} ({kind})")
    assert "it must be an int (not a bool)" in message


@pytest.mark.parametrize("value", [-16, 8, 48])
def test_a_buffer_start_off_the_chunks_or_past_the_skip_is_refused_by_the_range_rule(
    value: int,
) -> None:
    with pytest.raises(InputError, match=r"kv_start is -?\d+; it must be a multiple of"):
        check_buffer_start("kv_start", value, _prompt(32), 16)


@pytest.mark.parametrize("value", [0, 16, 32])
def test_a_chunk_start_at_or_before_the_skip_is_the_buffers_base(value: int) -> None:
    assert check_buffer_start("kv_start", value, _prompt(32), 16).base == value
