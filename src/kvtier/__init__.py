"""kvtier: a tiered KV-cache layer for LLM inference.

Quick start::

    import torch, kvtier
    layout = kvtier.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    config = kvtier.Config.load(overrides={"chunk_size": 16, "max_local_cpu_size": "64MiB"})
    with kvtier.Engine(config, layout, model_name="demo") as engine:
        tokens = list(range(64))
        engine.store(tokens, torch.randn(2, 2, 64, 128))
        with engine.request("r1"):
            hit = engine.lookup(tokens + [7, 8], "r1")      # Hit(tokens=64, cpu_tokens=64)
            kv = engine.retrieve(tokens + [7, 8], "r1")     # [2, 2, 64, 128]
"""

from typing import TYPE_CHECKING, Any

from kvtier.config import Config
from kvtier.errors import (
    CapacityError,
    ConfigError,
    CorruptRecord,
    InputError,
    KVTierError,
    ProtocolError,
    StateError,
    TierError,
    TierUnavailable,
    TransferError,
    TransferTimeout,
)

if TYPE_CHECKING:
    from kvtier.engine import Engine, EngineState
    from kvtier.fingerprint import Fingerprint
    from kvtier.hit import Hit
    from kvtier.keys import KeyChain
    from kvtier.layout import KVLayout
    from kvtier.server.client import ServerClient, connect
    from kvtier.service import Service

# Imported on first use (PEP 562): these import torch, and `import kvtier` must not, so
# that `kvtier check-config` or `kvtier --help` answers in a fraction of a second.
_LAZY = {
    "Engine": "kvtier.engine",
    "EngineState": "kvtier.engine",
    "Fingerprint": "kvtier.fingerprint",
    "Hit": "kvtier.hit",
    "KeyChain": "kvtier.keys",
    "KVLayout": "kvtier.layout",
    "ServerClient": "kvtier.server.client",
    "connect": "kvtier.server.client",
    "Service": "kvtier.service",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


__all__ = [
    "CapacityError",
    "Config",
    "ConfigError",
    "CorruptRecord",
    "Engine",
    "EngineState",
    "Fingerprint",
    "Hit",
    "InputError",
    "KVLayout",
    "KVTierError",
    "ServerClient",
    "Service",
    "KeyChain",
    "ProtocolError",
    "StateError",
    "TierError",
    "TierUnavailable",
    "TransferError",
    "TransferTimeout",
    "connect",
]

__version__ = "0.1.0"
