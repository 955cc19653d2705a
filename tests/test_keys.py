from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import blake3
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier import InputError, KVLayout
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.request_salt import ExtraKeys

LAYOUT = KVLayout(2, 2, 8, torch.float32)


def chain(**kw: object) -> KeyChain:
    values: dict[str, object] = {"model_name": "m", "layout": LAYOUT, "chunk_size": 4}
    values.update(kw)
    return KeyChain(Fingerprint(**values))  # type: ignore[arg-type]


def test_keys_name_whole_prefixes() -> None:
    c = chain()
    a = c.keys(list(range(12)), include_partial=False)
    b = c.keys([*range(8), 99, 9, 10, 11], include_partial=False)
    assert [s.key for s in a[:2]] == [s.key for s in b[:2]]
    assert a[2].key != b[2].key
    assert [(s.start, s.end) for s in a] == [(0, 4), (4, 8), (8, 12)]


def test_same_chunk_after_a_different_prefix_gets_a_different_key() -> None:
    c = chain()
    a = c.keys([1, 2, 3, 4, 5, 6, 7, 8], include_partial=False)
    b = c.keys([9, 9, 9, 9, 5, 6, 7, 8], include_partial=False)
    assert a[1].key != b[1].key


def test_partial_chunk_only_when_asked() -> None:
    c = chain()
    assert len(c.keys(list(range(10)), include_partial=False)) == 2
    spans = c.keys(list(range(10)), include_partial=True)
    assert len(spans) == 3 and (spans[2].start, spans[2].end) == (8, 10)
    longer = c.keys(list(range(12)), include_partial=False)
    assert longer[2].key != spans[2].key  # a partial chunk never matches the full one


@pytest.mark.parametrize(
    "change",
    [
        {"model_name": "other"},
        {"layout": KVLayout(3, 2, 8, torch.float32)},
        {"layout": KVLayout(2, 2, 8, torch.bfloat16)},
        {"chunk_size": 2},
        {"hash_algorithm": "sha256"},
        {"hash_algorithm": "blake3"},
        {"tp_rank": 1, "tp_world_size": 2},
        {"cache_salt": "tenant-b"},
    ],
)
def test_every_fingerprint_field_changes_every_key(change: dict[str, object]) -> None:
    tokens = list(range(8))
    base = chain().keys(tokens, include_partial=True)
    other = chain(**change).keys(tokens, include_partial=True)
    assert not {s.key for s in base} & {s.key for s in other}


def test_list_numpy_and_tensor_tokens_give_the_same_keys() -> None:
    c = chain()
    tokens = [5, 1, 4, 1, 5, 9, 2, 6]
    expected = c.keys(tokens, include_partial=False)
    for variant in (
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.int32),
        torch.tensor(tokens),
    ):
        assert c.keys(variant, include_partial=False) == expected


def test_keys_are_the_same_in_another_process() -> None:
    code = (
        "import torch; from kvtier import KVLayout; from kvtier.fingerprint import Fingerprint;"
        "from kvtier.keys import KeyChain;"
        "c = KeyChain(Fingerprint('m', KVLayout(2, 2, 8, torch.float32), 4));"
        "print(','.join(s.key.hex() for s in c.keys(list(range(12)), include_partial=False)))"
    )
    env = {"PYTHONHASHSEED": "12345"}
    if "PYTHONPATH" in os.environ:  # the child hashes with the kvtier under test, not another
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    here = ",".join(s.key.hex() for s in chain().keys(list(range(12)), include_partial=False))
    assert out.stdout.strip() == here


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        ([], "empty"),
        ([1, 2.5], "integers"),
        ([1, True], "integers"),
        ("abc", "sequence"),
        (np.zeros((2, 2), dtype=np.int32), "1-D"),
        (torch.ones(3), "integer tensor"),
        ([2**40], "int32"),
    ],
)
def test_bad_tokens_are_input_errors(tokens: object, fragment: str) -> None:
    with pytest.raises(InputError, match=fragment):
        chain().keys(tokens, include_partial=False)


def test_fingerprint_validation() -> None:
    with pytest.raises(InputError, match="model_name"):
        Fingerprint("", LAYOUT, 4)
    with pytest.raises(InputError, match="tp_rank"):
        Fingerprint("m", LAYOUT, 4, tp_rank=2, tp_world_size=2)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256", "blake3"])
@pytest.mark.parametrize(
    ("num_tokens", "partial"), [(3, True), (12, False), (14, True), (14, False)]
)
def test_keys_are_the_documented_chain(algorithm: str, num_tokens: int, partial: bool) -> None:
    """h_i = H(h_{i-1} || int32 LE bytes of chunk i), seeded by the fingerprint digest: the
    C-level pipeline in KeyChain.keys must give exactly these values (stored keys depend on
    them), for full chunks and a partial tail alike."""
    c = chain(hash_algorithm=algorithm)
    tokens = [(7 * t + 3) % 50_000 for t in range(num_tokens)]
    data = np.asarray(tokens, dtype="<i4").tobytes()
    hash_fn = {
        "xxh3_128": xxhash.xxh3_128_digest,
        "sha256": lambda b: hashlib.sha256(b).digest()[:16],
        "blake3": lambda b: bytes(blake3.blake3(b).digest(length=16)),
    }[algorithm]
    expected, prev = [], c.fingerprint.digest()
    ends = list(range(4, num_tokens + 1, 4)) + ([num_tokens] if partial and num_tokens % 4 else [])
    start = 0
    for end in ends:
        prev = hash_fn(prev + data[start * 4 : end * 4])
        expected.append((start, end, prev))
        start = end
    spans = c.keys(tokens, include_partial=partial)
    assert [(s.start, s.end, s.key) for s in spans] == expected
    assert [s.index for s in spans] == list(range(len(expected)))


def test_chunk_spans_slice_and_index_like_a_list() -> None:
    spans = chain().keys(list(range(14)), include_partial=True)
    as_list = list(spans)
    assert len(spans) == 4 and spans[-1] == as_list[-1] and spans[-1].end == 14
    for cut in (slice(1, None), slice(0, 2), slice(-2, None), slice(3, 1), slice(5, 9)):
        part = spans[cut]
        assert list(part) == as_list[cut] and len(part) == len(as_list[cut])
        assert part == as_list[cut]
        assert [part.end(i) for i in range(len(part))] == [s.end for s in as_list[cut]]
    with pytest.raises(IndexError):
        spans[4]


def test_a_request_salt_reseeds_every_key_and_equal_salts_share() -> None:
    c = chain()
    tokens = list(range(12))
    plain = [s.key for s in c.keys(tokens, include_partial=False)]
    a = [s.key for s in c.keys(tokens, include_partial=False, salt="tenant-A")]
    b = [s.key for s in c.keys(tokens, include_partial=False, salt="tenant-B")]
    again = [s.key for s in c.keys(tokens, include_partial=False, salt="tenant-A")]
    assert a == again  # equal salts share every chunk
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)
    # "" and None both mean "no salt" (vLLM's default), and a fresh chain agrees
    assert [s.key for s in c.keys(tokens, include_partial=False, salt="")] == plain
    assert [s.key for s in chain().keys(tokens, include_partial=False, salt="tenant-A")] == a


def test_a_request_salt_composes_with_the_engine_wide_salt() -> None:
    tokens = list(range(8))
    keys = {
        (engine_salt, salt): tuple(
            s.key
            for s in chain(cache_salt=engine_salt).keys(tokens, include_partial=False, salt=salt)
        )
        for engine_salt in ("", "fleet-1")
        for salt in (None, "t")
    }
    assert len(set(keys.values())) == 4  # every combination is its own key space


@pytest.mark.parametrize("salt", [3, b"x", "x" * 1025])
def test_a_bad_salt_is_an_input_error(salt: object) -> None:
    with pytest.raises(InputError, match="cache_salt"):
        chain().keys([1, 2, 3, 4], include_partial=False, salt=salt)  # type: ignore[arg-type]


def test_known_keys_are_reused_and_only_new_chunks_are_hashed() -> None:
    c = chain()
    tokens = list(range(22))  # 5 whole chunks of 4 and a tail of 2
    first = c.keys(tokens[:8], include_partial=False, salt="s")
    before = c.chunks_hashed
    longer = c.keys(tokens, include_partial=True, salt="s", known=first.keys)
    assert c.chunks_hashed - before == 4  # chunks 2..4 and the partial tail, not 0..1
    assert longer.keys == c.keys(tokens, include_partial=True, salt="s").keys


SALTS = st.sampled_from(
    [
        None,
        "tenant-a",
        ExtraKeys(salt="t", adapter=b"lora-digest"),
        ExtraKeys(items=((5, 9, b"image-digest"),)),
    ]
)


@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40),
    st.data(),
    SALTS,
)
def test_a_probes_partial_keys_are_the_keys_of_the_prefixes_they_end(
    tokens: list[int], data: st.DataObject, salt: ExtraKeys | str | None
) -> None:
    """``partial_keys`` (a checkpoint probe's many ends of one chunk, hashed from one copy of
    its tokens) gives, for each end, the last key of ``keys(tokens[:end])`` with its partial
    chunk: the key a store of that prefix wrote, for a plain salt, a string and keyed items."""
    c = chain()  # chunks of 4 tokens
    index = data.draw(st.integers(0, (len(tokens) - 1) // 4))
    start = index * 4
    ends = data.draw(st.lists(st.integers(start + 1, min(start + 4, len(tokens))), max_size=4))
    array = np.array(tokens, dtype=np.int64)
    known = c.keys(array[:start], include_partial=False, salt=salt).keys if start else []
    got = c.partial_keys(array, index, ends, salt=salt, known=known)
    expected = [c.keys(array[:end], include_partial=True, salt=salt).keys[index] for end in ends]
    assert got == expected
