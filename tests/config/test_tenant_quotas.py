"""``tenant_quotas`` rows have one bound however they are set: a limit out of range (NaN, inf,
a bool, an int of 400 digits, 1e20 GiB) is a :class:`ConfigError` naming the key, the value
and the range, never an ``OverflowError``; and every limit taken reads back from its saved
form (the disk tier's ``.tenants`` file)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.config import Config
from kvtier.config.sizes import GIB
from kvtier.config.tenant_quotas import (
    MAX_LIMIT_BYTES,
    MAX_LIMIT_GIB,
    limit_of_gib,
    parse_limit,
    parse_tenant_quotas,
)
from kvtier.errors import ConfigError


@pytest.mark.parametrize(
    "raw",
    [
        10**400,  # float() of it raised OverflowError
        -(10**400),
        1e300,  # 1e300 GiB is inf bytes
        1e20,
        MAX_LIMIT_GIB + 1,
        math.nan,
        math.inf,
        -1,
        True,
        "1e20",
        "9" * 400,
        "2PiB",
        "1e-323%",  # a share that divides to 0
        [1],
    ],
)
def test_a_limit_out_of_range_names_the_key_and_the_range(raw: object) -> None:
    with pytest.raises(ConfigError, match=r"tenant_quotas\['a'\].*from 0 to 1 PiB") as caught:
        parse_tenant_quotas("tenant_quotas", {"a": raw})
    assert len(str(caught.value)) < 400  # a huge int is named by its length, not quoted


def test_a_config_file_with_a_huge_int_limit_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tenant_quotas:\n  a: " + "1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError, match="an integer of about 401 digits"):
        Config.load(path)


def test_the_bound_itself_is_a_limit() -> None:
    assert parse_limit("k", MAX_LIMIT_GIB).nbytes == MAX_LIMIT_BYTES == 1024**5
    assert parse_limit("k", "1TiB").nbytes == 1024**4
    assert parse_limit("k", f"{MAX_LIMIT_BYTES}B").nbytes == MAX_LIMIT_BYTES
    assert limit_of_gib("k", 0.5).nbytes == GIB // 2


@given(
    st.one_of(
        st.integers(0, MAX_LIMIT_GIB),
        st.floats(0, MAX_LIMIT_GIB),
        st.integers(0, MAX_LIMIT_BYTES).map(lambda n: f"{n}B"),
        st.floats(1e-300, 100).map(lambda p: f"{p!r}%"),
    )
)
def test_every_limit_taken_reads_back_from_its_saved_form(raw: object) -> None:
    """What the disk tier saves (``spec()``) parses again: a row taken is never a row that
    makes the next open refuse the saved table."""
    limit = parse_limit("k", raw)
    again = parse_limit("k", limit.spec())
    assert again.nbytes == limit.nbytes
    assert again.share == pytest.approx(limit.share)
