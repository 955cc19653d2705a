"""Odd arguments to every public Engine call: only kvtier errors may come out, naming the
argument (foreign exceptions are translated where they enter)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import Engine, InputError
from kvtier.errors import KVTierError
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(small_config(), SMALL_LAYOUT, model_name="inputs") as engine:
        yield engine


def _tensors() -> st.SearchStrategy[object]:
    hidden = SMALL_LAYOUT.hidden
    return st.sampled_from(
        [
            lambda: torch.zeros(2, 2, 16, hidden, device="meta"),
            lambda: torch.zeros(2, 2, 16, hidden).to_sparse(),
            lambda: torch.zeros(16, dtype=torch.int64).to_sparse(),
            lambda: torch.zeros(16, dtype=torch.int64, device="meta"),
            lambda: torch.zeros(2, 2, 16, hidden, dtype=torch.complex64),
            lambda: torch.zeros(2, 2, 16, hidden)[..., ::2],
            lambda: torch.zeros(2, 2, 16, hidden, dtype=torch.bool),
            lambda: torch.tensor(5),
            lambda: torch.zeros(0, dtype=torch.int32),
            lambda: torch.arange(16, dtype=torch.uint8),
            lambda: torch.full((16,), 2**40, dtype=torch.int64),
            lambda: torch.nested.nested_tensor(
                [torch.zeros(3), torch.zeros(4)], layout=torch.jagged
            ),
        ]
    ).map(lambda make: make())


ODD_SCALARS = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.complex_numbers(),
)

ODD_TOKENS = st.one_of(
    st.lists(st.integers(min_value=-(2**80), max_value=2**80), min_size=1, max_size=40),
    st.lists(ODD_SCALARS, max_size=5),
    st.lists(st.lists(st.integers(0, 5), max_size=3), max_size=3),
    ODD_SCALARS,
    st.sampled_from(
        [
            np.array([2**40] * 16, dtype=np.int64),
            np.array([2**63 + 5] * 16, dtype=np.uint64),
            np.array([1.5] * 16),
            np.array(["a"] * 16),
            np.array([1, 2], dtype=object),
            np.zeros((2, 8), dtype=np.int32),
            np.array(7),
        ]
    ),
    _tensors(),
)

ODD_KV = st.one_of(ODD_SCALARS, _tensors(), st.just(make_kv(16)))


def _only_kvtier_errors(call: object, *args: object, **kwargs: object) -> None:
    with contextlib.suppress(KVTierError):  # anything else fails the test
        call(*args, **kwargs)  # type: ignore[operator]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tokens=ODD_TOKENS, kv=ODD_KV, request_id=st.one_of(ODD_SCALARS, st.just("r")), skip=ODD_SCALARS
)
def test_odd_arguments_raise_only_kvtier_errors(
    engine: Engine, tokens: object, kv: object, request_id: object, skip: object
) -> None:
    try:
        _only_kvtier_errors(engine.lookup, tokens, request_id)
        _only_kvtier_errors(engine.lookup, tokens, "r", skip_leading_tokens=skip)
        _only_kvtier_errors(engine.retrieve, tokens, "r")
        _only_kvtier_errors(engine.retrieve_into, tokens, "r", kv)
        _only_kvtier_errors(engine.retrieve_into, make_tokens(16), "r", kv)
        _only_kvtier_errors(engine.store, tokens, kv)
        _only_kvtier_errors(engine.store, make_tokens(16), kv, skip_leading_tokens=skip)
        _only_kvtier_errors(engine.end_request, request_id)
    finally:
        engine.end_request("r")
    assert engine.check_invariants() == []


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seconds=ODD_SCALARS, prompt=ODD_SCALARS, hit=ODD_SCALARS)
def test_odd_record_ttft_arguments_raise_only_input_errors(
    engine: Engine, seconds: object, prompt: object, hit: object
) -> None:
    _only_kvtier_errors(engine.record_ttft, seconds, prompt_tokens=prompt, hit_tokens=hit)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda e: e.lookup([2**70] * 16, "r"), "tokens"),
        (lambda e: e.lookup(np.array([2**63 + 5] * 16, dtype=np.uint64), "r"), "tokens"),
        (lambda e: e.lookup(torch.zeros(16, dtype=torch.int64, device="meta"), "r"), "tokens"),
        (lambda e: e.lookup(torch.zeros(16, dtype=torch.int64).to_sparse(), "r"), "tokens"),
        (lambda e: e.store(make_tokens(16), make_kv(16).to("meta")), "kv"),
        (lambda e: e.store(make_tokens(16), make_kv(16).to_sparse()), "kv"),
        (lambda e: e.record_ttft(float("nan"), prompt_tokens=5, hit_tokens=1), "seconds"),
        (lambda e: e.record_ttft("fast", prompt_tokens=5, hit_tokens=1), "seconds"),  # type: ignore[arg-type]
        (lambda e: e.record_ttft(0.1, prompt_tokens=None, hit_tokens=1), "prompt_tokens"),  # type: ignore[arg-type]
        (lambda e: e.record_ttft(0.1, prompt_tokens=5, hit_tokens=9), "hit_tokens"),
        (lambda e: e.record_ttft(0.1, prompt_tokens=2**70, hit_tokens=1), "prompt_tokens"),
    ],
)
def test_each_foreign_error_becomes_an_input_error_naming_the_argument(
    engine: Engine, call: object, argument: str
) -> None:
    with pytest.raises(InputError, match=argument):
        call(engine)  # type: ignore[operator]
    engine.end_request("r")
