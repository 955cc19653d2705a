from __future__ import annotations

import pytest

from kvtier import ConfigError
from kvtier.config.sizes import GIB, format_size, parse_size


@pytest.mark.parametrize(
    ("raw", "unit", "expected"),
    [
        (1, GIB, GIB),
        (1, 1, 1),
        ("1KiB", 1, 1024),
        ("1kB", 1, 1000),
        ("3 MB", GIB, 3_000_000),
        ("10", 1, 10),
        ("0.5GiB", 1, GIB // 2),
        ("7B", GIB, 7),
    ],
)
def test_parse_size(raw: object, unit: int, expected: int) -> None:
    assert parse_size("k", raw, unit) == expected


@pytest.mark.parametrize("raw", [True, None, "-1MiB", "MiB", "1 XB", float("nan"), [1]])
def test_parse_size_rejects(raw: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size("some_size", raw, 1)
    assert info.value.key == "some_size"


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(5 * GIB) == "5.00 GiB"
