"""The README's config table is the schema, and every key it documents does something.

A key that parses but is read nowhere looks configured while changing nothing (LMCache's
``pd_proxy_host`` did, for a release): each key of the table must be read as a ``Config``
attribute somewhere outside the config package, and each LMCache key the loader ignores
(docs/lmcache.md's "ignored" rows, warned about at load) must be read nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.cli.check_config import key_table
from kvtier.config.lmcache_keys import IGNORED, LMCACHE_KEYS
from kvtier.config.schema import KEYS

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "kvtier"


def _code_outside_config() -> str:
    return "\n".join(
        path.read_text()
        for path in sorted(SRC.rglob("*.py"))
        if (SRC / "config") not in path.parents
    )


CODE = _code_outside_config()


def _read_as_attribute(name: str) -> bool:
    return re.search(rf"\.{re.escape(name)}\b", CODE) is not None


def test_the_readme_config_table_is_the_schema() -> None:
    readme = (ROOT / "README.md").read_text()
    for row in key_table().splitlines():
        assert row in readme, f"README.md's config table lacks or differs in: {row}"
    table = readme.split("| key | default | meaning |", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `(\w+)(?: \(kvtier\))?` \|", table, re.MULTILINE)
    assert set(documented) == {spec.name for spec in KEYS}


@pytest.mark.parametrize("name", [spec.name for spec in KEYS])
def test_every_documented_key_is_read_outside_the_config_package(name: str) -> None:
    assert _read_as_attribute(name), f"config key {name!r} is parsed but read nowhere"


IGNORED_KEYS = [row.name for row in LMCACHE_KEYS if row.status == IGNORED and row.is_key]


@pytest.mark.parametrize("name", IGNORED_KEYS)
def test_a_key_documented_as_no_effect_is_read_nowhere(name: str) -> None:
    assert not _read_as_attribute(name), f"{name!r} is documented as no effect, yet read"


def test_the_keys_lmcache_parses_and_kvtier_never_read_are_documented_as_no_effect() -> None:
    for name in ("pd_peer_init_port", "pd_proxy_host", "pd_proxy_port"):
        assert name in IGNORED_KEYS
        assert name not in {spec.name for spec in KEYS}
