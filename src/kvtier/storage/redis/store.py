"""Chunks in Redis or Redis Cluster (or Valkey): the store under the remote tier.

Names and values::

    key    kvtier:<fingerprint hex>:<chunk key hex>     e.g. kvtier:3f2a...:9c01...
    value  one record of kvtier.storage.records (built by the tier)

The fingerprint in every name lets the tier's ``clear`` delete exactly this engine's
namespace (``SCAN MATCH kvtier:<fp>:*``). Names carry no ``{hash tag}``, so a cluster spreads
chunks over all its masters.

Each call of :class:`~kvtier.storage.remote.store.ObjectStore` as Redis commands (for one
server or a cluster: :mod:`kvtier.storage.redis.commands`):

* ``exists_many``: one round trip: a script running ``EXISTS`` per key on one server (a
  pipeline where the server refuses ``EVAL``), a pipeline of ``EXISTS`` per master on a
  cluster.
* ``get_into``: ``GET`` read straight into the page (:mod:`kvtier.storage.redis.wire`),
  header and stored checksum verified as the bytes land.
* ``put``: ``SET`` of the record's parts as they are (optional expiry:
  ``extra_config.remote_ttl_secs``, ``SET ... PX``).
* ``delete_many``: one ``UNLINK`` per name, pipelined per master; ``list_keys``: ``SCAN``.
* ``usage``: ``used_memory``, ``maxmemory`` (or the host's memory when unlimited) and
  ``DBSIZE`` summed over the masters: other models' chunks and other data included.
* ``available``: the link's state (:mod:`kvtier.storage.redis.link`): a server that is down
  at open, or dies mid-run, is reconnected in the background with backoff; meanwhile the
  tier misses and drops at once. A stalled server costs at most ``blocking_timeout_secs``
  per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from kvtier.config.remote_url import RemoteTarget
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.storage.base import TierUsage
from kvtier.storage.redis.commands import (
    exists_by_script,
    exists_pipelined,
    read_record,
    scan_matching,
    send_record,
    server_usage,
    unlink_each,
)
from kvtier.storage.redis.link import RedisLink
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.remote.store import ObjectStore, RemoteCounters, Visible

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RedisCounters(RemoteCounters):
    """The Redis tier's own counts (copied from the link at ``usage()``)."""

    reconnects: int = 0  # the server came back after an outage
    busy_timeouts: int = 0  # every connection was busy past the timeout


class RedisStore(ObjectStore):
    """See the module docstring."""

    name = "redis"
    log = log
    counters: RedisCounters

    def __init__(self, target: RemoteTarget, fingerprint: Fingerprint, options: RedisOptions):
        self.counters = RedisCounters()
        self.target = target
        self.options = options
        self.fingerprint = fingerprint  # records are verified against it
        self.prefix = f"kvtier:{fingerprint.hex()}:".encode()
        self.link = RedisLink(
            target,
            options.timeout_s,
            # Writers and engine calls share the gate, so each writer has its connection and
            # the engine still has ``connections`` for lookups and reads.
            max_connections=options.put_threads + options.connections,
            name=self.name,
            tls_ca_file=options.tls_ca_file,
        )
        self._use_script = True  # until the server refuses EVAL
        self._set_options: tuple[bytes, ...] = (
            (b"PX", str(int(options.ttl_s * 1000)).encode()) if options.ttl_s else ()
        )

    @property
    def where(self) -> str:
        return self.target.describe()

    @property
    def timeout_s(self) -> float:
        return self.options.timeout_s

    def open(self) -> None:
        self.link.open()

    def close(self) -> None:
        self.link.close()

    def available(self) -> bool:
        return self.link.is_up

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` through the link (redis errors translated there)."""
        return self.link.call(fn)

    def name_of(self, key: ChunkKey) -> bytes:
        """The Redis key under which chunk ``key`` is stored."""
        return self.prefix + key.hex().encode()

    def _key_of(self, name: bytes) -> ChunkKey:
        """The chunk key of a Redis name of this store (the inverse of :meth:`name_of`)."""
        return bytes.fromhex(name[len(self.prefix) :].decode())

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        name, fingerprint = self.name_of(key), self.fingerprint
        return self.call(lambda client: read_record(client, name, key, fingerprint, out))

    def put(self, key: ChunkKey, parts: Sequence[bytes | memoryview], then: Visible) -> None:
        name, joined = self.name_of(key), list(parts)
        self.call(lambda client: send_record(client, name, joined, self._set_options))
        then((key,))  # the server has it now

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        names = [self.name_of(k) for k in keys]

        def exists(client: Any) -> list[Any]:
            if self._use_script and not isinstance(client, RedisCluster):
                try:
                    return exists_by_script(client, names)
                except ResponseError as exc:
                    # Scripting disabled or restricted (some managed services): pipeline.
                    log.info("redis EVAL refused (%s); using pipelined EXISTS", exc)
                    self._use_script = False
            return exists_pipelined(client, names)

        return [bool(n) for n in self.call(exists)]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        names = [self.name_of(k) for k in keys]
        return self.call(lambda client: unlink_each(client, names))

    def list_keys(self) -> list[ChunkKey]:
        names = self.call(lambda client: scan_matching(client, self.prefix + b"*"))
        return [self._key_of(name) for name in names]

    def usage(self) -> TierUsage:
        return self.call(server_usage)

    def note_counters(self) -> None:
        self.counters.outages = self.link.outages
        self.counters.reconnects = self.link.reconnects
        self.counters.busy_timeouts = self.link.busy_timeouts
