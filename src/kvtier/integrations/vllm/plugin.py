"""vLLM's ``vllm.general_plugins`` entry point: makes ``"kv_connector":"KVTierConnector"``
work without ``kv_connector_module_path``. vLLM loads it in every process it starts."""

from __future__ import annotations

import contextlib


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # Plugins can load twice in one process; the second registration raises ValueError.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            "KVTierConnector", "kvtier.integrations.vllm.connector", "KVTierConnector"
        )
