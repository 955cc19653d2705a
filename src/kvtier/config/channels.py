"""The PD transports ``transfer_channel`` may name, and whether each can run here.

The names live in config (not in :mod:`kvtier.pd.channels`) so that a config is validated
without importing the transports; the transports' factory reads them from here.
"""

from __future__ import annotations

import importlib.util

from kvtier.errors import ConfigError

TRANSFER_CHANNELS = ("tcp", "shm", "nixl")
NIXL_UNAVAILABLE = (
    "tcp or shm: the nixl package is not installed (pip install 'kvtier[nixl]', which is "
    "nixl-cu12==1.5.1; it runs on CPU hosts too: DRAM registration over UCX)"
)


def nixl_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu12"))


def check_channel(name: str | None) -> str:
    """The transport to use for ``transfer_channel`` (None means tcp)."""
    chosen = name or "tcp"
    if chosen == "nixl" and not nixl_installed():
        raise ConfigError("transfer_channel", name, NIXL_UNAVAILABLE)
    if chosen not in TRANSFER_CHANNELS:
        raise ConfigError("transfer_channel", name, f"one of {TRANSFER_CHANNELS}")
    return chosen
