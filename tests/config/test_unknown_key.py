"""A key kvtier does not know is reported as unknown: its value is not the problem (issue 50,
item 10: the message said "invalid value '(not shown)'")."""

from __future__ import annotations

import pytest

from kvtier.config import Config
from kvtier.errors import ConfigError


def test_a_misspelt_key_is_reported_as_unknown_not_as_a_bad_value() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={}, overrides={"max_local_cpu_sise": "2GiB"})
    message = str(info.value)
    assert message.startswith("config key 'max_local_cpu_sise': no such key (from override)")
    assert "did you mean 'max_local_cpu_size'?" in message
    assert "invalid value" not in message and "not shown" not in message
    assert "2GiB" not in message  # the value is not the problem, and may be a secret
    assert info.value.key == "max_local_cpu_sise"
