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

from kvtier.config import Config
from kvtier.engine import Engine, EngineState
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
from kvtier.fingerprint import Fingerprint
from kvtier.hit import Hit
from kvtier.keys import KeyChain
from kvtier.layout import KVLayout
from kvtier.server.client import ServerClient, connect
from kvtier.service import Service

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
