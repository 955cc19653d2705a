"""vLLM's ``vllm.general_plugins`` entry point: makes ``"kv_connector":"KVTierConnector"``
work without ``kv_connector_module_path``. vLLM loads it in every process it starts.

It also answers an LMCache user who kept ``"kv_connector":"LMCacheConnectorV1"`` on a host
without LMCache: vLLM's own entry for that name imports ``lmcache`` and dies with ``No module
named 'lmcache'`` deep in a 250-line traceback. Where ``lmcache`` is not installed, the entry
is replaced by one that logs and raises one line naming the connector to use instead (where
it is installed, LMCache's connector is left alone: that name still means LMCache).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from typing import Any

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

LMCACHE_CONNECTOR = "LMCacheConnectorV1"
INSTEAD = (
    '"kv_connector":"KVTierConnector" with "kv_connector_module_path":'
    '"kvtier.integrations.vllm": the lmcache package is not installed, and kvtier reads your '
    "LMCache config unchanged (LMCACHE_CONFIG_FILE, LMCACHE_*; docs/lmcache.md, "
    "'Your vLLM command')"
)


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # Plugins can load twice in one process; the second registration raises ValueError.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            "KVTierConnector", "kvtier.integrations.vllm.connector", "KVTierConnector"
        )
    answer_missing_lmcache(KVConnectorFactory._registry)


def answer_missing_lmcache(registry: dict[str, Any]) -> bool:
    """Replace the LMCache connector's loader in vLLM's connector ``registry`` by one that
    says what to use instead, when ``lmcache`` is not installed. True if it did."""
    if LMCACHE_CONNECTOR not in registry or importlib.util.find_spec("lmcache") is not None:
        return False
    registry[LMCACHE_CONNECTOR] = _refuse_lmcache
    return True


def _refuse_lmcache() -> type:
    error = ConfigError("kv_connector", LMCACHE_CONNECTOR, INSTEAD)
    # First, as one line of vLLM's log: the raise below ends in vLLM's long traceback.
    log.error("kvtier: %s", error)
    raise error
