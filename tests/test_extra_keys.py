"""Extra keys: what names a request's KV besides its tokens (a LoRA adapter, images, prompt
embeddings). Equal tokens with other extra keys never share a chunk that the extra keys
touch; chunks no item touches are shared with plain text, as in vLLM's own prefix cache."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier import InputError, KVLayout
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain, RequestKeys
from kvtier.request_salt import ExtraKeys, check_salt

LAYOUT = KVLayout(2, 2, 8, torch.float32)
SIZE = 4
TOKENS = list(range(100, 116))  # 4 chunks of 4


def chain() -> KeyChain:
    return KeyChain(Fingerprint(model_name="m", layout=LAYOUT, chunk_size=SIZE))


def keys(salt: object = None, tokens: list[int] = TOKENS, partial: bool = False) -> list[bytes]:
    return chain().keys(tokens, include_partial=partial, salt=check_salt(salt)).keys


def test_an_adapter_keys_every_chunk_apart_from_the_base_model_and_other_adapters() -> None:
    base, a, b = keys(), keys(ExtraKeys(adapter=b"A" * 16)), keys(ExtraKeys(adapter=b"B" * 16))
    for one, two in [(base, a), (base, b), (a, b)]:
        assert not set(one) & set(two)
    assert keys(ExtraKeys(adapter=b"A" * 16)) == a  # the same adapter shares


def test_an_item_keys_the_chunks_it_overlaps_and_every_chunk_after_them() -> None:
    plain = keys()
    image1 = keys(ExtraKeys(items=((5, 7, b"image-1"),)))
    image2 = keys(ExtraKeys(items=((5, 7, b"image-2"),)))
    # Chunk 0 comes before the image: shared with plain text, as in vLLM.
    assert image1[0] == plain[0] == image2[0]
    # Chunk 1 holds the image; chunks 2 and 3 follow it through the chain.
    for i in (1, 2, 3):
        assert len({plain[i], image1[i], image2[i]}) == 3
    assert keys(ExtraKeys(items=((5, 7, b"image-1"),))) == image1


def test_an_item_at_another_position_is_another_key() -> None:
    here = keys(ExtraKeys(items=((5, 7, b"image"),)))
    there = keys(ExtraKeys(items=((6, 8, b"image"),)))
    assert here[0] == there[0] and here[1] != there[1]


def test_an_item_spanning_chunks_keys_each_of_them() -> None:
    plain = keys()
    wide = keys(ExtraKeys(items=((6, 13, b"image"),)))  # chunks 1, 2 and 3
    assert wide[0] == plain[0]
    assert all(w != p for w, p in zip(wide[1:], plain[1:], strict=True))


def test_a_salt_and_extra_keys_compose_and_a_bare_extra_keys_is_its_salt() -> None:
    assert check_salt(ExtraKeys(salt="tenant")) == "tenant"
    assert check_salt(ExtraKeys()) is None
    assert keys(ExtraKeys(salt="tenant")) == keys("tenant")
    salted = keys(ExtraKeys(salt="tenant", adapter=b"A" * 16))
    assert not set(salted) & set(keys(ExtraKeys(adapter=b"A" * 16)))
    assert not set(salted) & set(keys("tenant"))


def test_a_keyed_partial_chunk_never_equals_a_chunk_of_tokens() -> None:
    """The suffix makes a keyed chunk 2 mod 4 bytes long: no token sequence hashes alike."""
    keyed = keys(ExtraKeys(items=((0, 2, b"x"),)), tokens=[1, 2], partial=True)
    for n in range(1, 8):
        assert keyed[0] not in keys(tokens=list(range(n)), partial=True)


@pytest.mark.parametrize(
    "bad",
    [
        ExtraKeys(items=((3, 3, b"d"),)),  # empty range
        ExtraKeys(items=((-1, 3, b"d"),)),
        ExtraKeys(items=((5, 6, b"d"), (1, 2, b"d"))),  # not sorted
        ExtraKeys(items=((1, 2, b""),)),  # no digest
        ExtraKeys(items=((1, 2, b"d" * 65),)),
        ExtraKeys(adapter=b"a" * 65),
        ExtraKeys(salt="s" * 2000, adapter=b"a"),
    ],
)
def test_bad_extra_keys_are_input_errors(bad: ExtraKeys) -> None:
    with pytest.raises(InputError):
        check_salt(bad)


def test_extra_keys_cross_the_wire_unchanged() -> None:
    extra = ExtraKeys("s", b"A" * 16, ((5, 7, b"img"),), ("lora adapter 'A'",))
    wire = msgspec.msgpack.encode(extra)
    assert msgspec.msgpack.decode(wire, type=ExtraKeys) == extra


def test_request_keys_reuse_known_chunks_only_under_the_same_extra_keys() -> None:
    c = chain()
    import numpy as np

    tokens = np.asarray(TOKENS, dtype=np.int32)
    image = check_salt(ExtraKeys(items=((5, 7, b"image"),)))
    first = RequestKeys(c, tokens, image, False)
    assert first.for_tokens(tokens, None).spans.keys == keys()
    assert first.for_tokens(tokens, image) is first


@given(
    st.lists(
        st.tuples(st.integers(0, 15), st.integers(1, 6), st.binary(min_size=1, max_size=8)),
        max_size=4,
    )
)
def test_the_chunks_before_the_first_item_are_plain_and_the_rest_are_not(
    raw: list[tuple[int, int, bytes]],
) -> None:
    items = tuple(sorted((s, s + n, d) for s, n, d in raw))
    plain, keyed = keys(), keys(ExtraKeys(items=items))
    first = min((s // SIZE for s, _, _ in items), default=len(plain))
    first = min(first, len(plain))
    assert keyed[:first] == plain[:first]
    assert all(k != p for k, p in zip(keyed[first:], plain[first:], strict=True))
