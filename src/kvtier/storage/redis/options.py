"""The remote tier's options, read and validated from config.

From ``blocking_timeout_secs``: every socket connect/read/write of the tier is bounded by it.
From ``extra_config`` (each bad value is a :class:`ConfigError` naming ``extra_config.<key>``):

====================== ========= =================================================================
key                    default   meaning
====================== ========= =================================================================
remote_ttl_secs        none      expire each chunk this many seconds after it was written
remote_put_threads     2         writer threads (each with its own connection)
remote_connections     16        engine calls (lookups, reads) served at once, per server; more
                                 wait for a connection up to ``blocking_timeout_secs``, then miss
remote_inflight_bytes  256MiB    bytes queued or being sent; a put beyond it is DROPPED at once
remote_tls_ca_file     none      CA bundle that signed the server's certificate (rediss://)
====================== ========= =================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtier.config import Config
from kvtier.config import parsers as p
from kvtier.config.sizes import MIB, parse_size
from kvtier.errors import ConfigError

MAX_TTL_S = 10 * 365 * 24 * 3600.0
DEFAULT_INFLIGHT_BYTES = 256 * MIB


@dataclass(frozen=True, slots=True)
class RedisOptions:
    timeout_s: float = 10.0
    ttl_s: float | None = None
    put_threads: int = 2
    connections: int = 16
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    tls_ca_file: str | None = None

    @classmethod
    def from_config(cls, config: Config) -> RedisOptions:
        extra = config.extra_config or {}
        ttl_raw = extra.get("remote_ttl_secs")
        ttl = None
        if ttl_raw is not None:
            ttl = p.positive_float(MAX_TTL_S)("extra_config.remote_ttl_secs", ttl_raw)
            if ttl < 0.001:  # Redis expiries are whole milliseconds
                raise ConfigError(
                    "extra_config.remote_ttl_secs", ttl_raw, f"seconds from 0.001 to {MAX_TTL_S:g}"
                )
        threads = p.integer(1, 32)(
            "extra_config.remote_put_threads", extra.get("remote_put_threads", 2)
        )
        connections = p.integer(1, 1024)(
            "extra_config.remote_connections", extra.get("remote_connections", 16)
        )
        inflight = parse_size(
            "extra_config.remote_inflight_bytes",
            extra.get("remote_inflight_bytes", DEFAULT_INFLIGHT_BYTES),
            1,
        )
        if inflight == 0:
            raise ConfigError(
                "extra_config.remote_inflight_bytes", 0, "a size above 0, e.g. '256MiB'"
            )
        ca_file = extra.get("remote_tls_ca_file")
        if ca_file is not None and (not isinstance(ca_file, str) or not os.path.isfile(ca_file)):
            raise ConfigError("extra_config.remote_tls_ca_file", ca_file, "a readable PEM file")
        return cls(
            tls_ca_file=ca_file,
            timeout_s=config.blocking_timeout_secs,
            ttl_s=ttl,
            put_threads=threads,
            connections=connections,
            inflight_bytes=inflight,
        )
