from __future__ import annotations

import pytest

from kvtier import ConfigError
from kvtier.config import Config
from kvtier.config.sizes import GIB, format_size, parse_size, size_note, size_notes


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


@pytest.mark.parametrize(
    ("raw", "note"),
    [
        (
            5,
            "max_local_cpu_size 5.00 GiB (file c.yaml: 5 as a bare number or '5GiB'; "
            "'5GB' would be 4.66 GiB)",
        ),
        (
            "5GiB",
            "max_local_cpu_size 5.00 GiB (file c.yaml: 5 as a bare number or '5GiB'; "
            "'5GB' would be 4.66 GiB)",
        ),
        (
            "5GB",
            "max_local_cpu_size 4.66 GiB (file c.yaml: '5GB' is decimal; a bare 5 would "
            "be 5.00 GiB)",
        ),
        ("100MiB", "max_local_cpu_size 100.00 MiB (file c.yaml)"),
    ],
)
def test_size_note_says_which_reading_a_gb_size_got(raw: object, note: str) -> None:
    nbytes = parse_size("max_local_cpu_size", raw, GIB)
    assert size_note("max_local_cpu_size", nbytes, {"max_local_cpu_size": "file c.yaml"}) == note


def test_size_notes_name_the_disk_size_only_with_a_disk_tier() -> None:
    cfg = Config.load(env={})
    assert size_notes(cfg) == (
        "max_local_cpu_size 5.00 GiB (default: 5 as a bare number or '5GiB'; '5GB' would be "
        "4.66 GiB)"
    )
    disk = Config.load(env={}, overrides={"local_disk": "/d", "max_local_disk_size": "20GB"})
    assert size_notes(disk).endswith(
        "; max_local_disk_size 18.63 GiB (override: '20GB' is decimal; a bare 20 would be "
        "20.00 GiB)"
    )
