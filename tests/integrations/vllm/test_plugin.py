"""kvtier's vLLM plugin, loaded as vLLM loads it (its general-plugins entry point): the
connector by name, and LMCache's connector name answered with what to use instead when
lmcache is not installed (issue 50, item 2)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path

import pytest

from kvtier.errors import ConfigError


def test_lmcaches_connector_name_without_lmcache_says_to_use_kvtiers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    assert importlib.util.find_spec("lmcache") is None  # this environment has no LMCache
    load_general_plugins()  # vLLM's own loader runs kvtier's entry point
    assert KVConnectorFactory.get_connector_class_by_name("KVTierConnector").__name__ == (
        "KVTierConnector"
    )
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError) as info:
        KVConnectorFactory.get_connector_class_by_name("LMCacheConnectorV1")
    text = str(info.value)
    assert "'kv_connector'" in text and "LMCacheConnectorV1" in text
    assert '"kv_connector":"KVTierConnector"' in text and "kvtier.integrations.vllm" in text
    assert "No module named" not in text
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"kvtier: {text}"]  # one line in vLLM's log, before its traceback


def test_where_lmcache_is_installed_its_connector_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """LMCache cannot be installed here (its wheels need CUDA): a package named lmcache on
    the path stands for it, found by the same find_spec the plugin asks."""
    from kvtier.integrations.vllm import plugin

    def lmcaches_loader() -> type:
        return object

    registry: dict[str, object] = {"LMCacheConnectorV1": lmcaches_loader}
    assert plugin.answer_missing_lmcache(registry) is True  # here: not installed
    registry["LMCacheConnectorV1"] = lmcaches_loader
    (tmp_path / "lmcache").mkdir()
    (tmp_path / "lmcache" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert plugin.answer_missing_lmcache(registry) is False
    assert registry["LMCacheConnectorV1"] is lmcaches_loader
