"""The kvtier server: one cache per host, shared by every engine process on it.

``kvtier server`` (:class:`~kvtier.server.daemon.KVTierServer`) owns each model's engine,
with its CPU page buffer in shared memory; :func:`connect` gives an engine process a client
with the cache surface (:class:`kvtier.cache.KVCache`, as an Engine has it). See docs/server.md.
"""

from kvtier.server.client import ServerClient, connect
from kvtier.server.daemon import KVTierServer

__all__ = ["KVTierServer", "ServerClient", "connect"]
