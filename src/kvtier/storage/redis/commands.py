"""The remote tier's operations as Redis commands, on one server or a cluster alike.

Each function takes the client the link hands a call (:meth:`RedisLink.call`): a plain
``Redis`` for one server, a ``RedisCluster`` for a cluster. What differs between the two is
settled here, so the store (:mod:`kvtier.storage.redis.store`) only decides what a result or an
error means for it:

* a cluster refuses a script or a multi-key command over keys in different slots, so lookups
  pipeline there and deletions go one ``UNLINK`` per name, master by master;
* a record is read and written on the connection of the master owning its slot
  (:mod:`kvtier.storage.redis.wire`, no copy); when the slot moved meanwhile (resharding)
  the command is sent again through the client, which follows the redirect.

Errors are redis-py's own; the link translates them (the boundary of the error mapping).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from redis.cluster import RedisCluster
from redis.exceptions import AskError, MovedError

from kvtier.errors import CorruptRecord
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.storage import record_reads, records
from kvtier.storage.base import TierUsage
from kvtier.storage.redis.wire import get_into, set_parts

# One EXISTS per key in a single command: on one server this answers a 512-chunk lookup in
# about 0.8 ms, against 2.4 ms for a redis-py pipeline of 512 EXISTS (packing in Python
# dominates). A cluster refuses scripts over keys in different slots, so it pipelines.
_EXISTS_EACH = (
    "local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('EXISTS', k) end return r"
)

SCAN_BATCH = 1000  # names scanned, or unlinked, per round trip


def exists_by_script(client: Any, names: Sequence[bytes]) -> list[Any]:
    """EXISTS for each name in one script call (one server only). Raises redis-py's
    ``ResponseError`` where scripting is disabled or restricted (some managed services)."""
    return list(client.eval(_EXISTS_EACH, len(names), *names))


def exists_pipelined(client: Any, names: Sequence[bytes]) -> list[Any]:
    """EXISTS for each name as pipelines: one for a server, one per master of a cluster."""
    if isinstance(client, RedisCluster):
        return _cluster_exists(client, names)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(name)
    return list(pipe.execute())


def read_record(
    client: Any, name: bytes, key: ChunkKey, fingerprint: Fingerprint, out: torch.Tensor
) -> int | None:
    """``GET`` chunk ``key``'s record (stored as ``name``) into ``out``: its token count, or
    None when there is no such record. The header and the stored checksum are verified as the
    bytes land (no second pass). Raises :class:`CorruptRecord` and the errors of
    :func:`kvtier.storage.records.decode_header` (another format, another codec)."""
    head = bytearray(records.header_size())
    found: list[tuple[records.RecordHeader, memoryview]] = []

    def place(head_view: memoryview, rest: int) -> memoryview:
        header = records.decode_header(head_view, fingerprint, key)
        if header.stored_len != rest:
            raise CorruptRecord(f"record has {rest} stored bytes, header says {header.stored_len}")
        stored = record_reads.stored_target(header, out)  # identity: the page itself
        found.append((header, stored))
        return stored

    hasher = record_reads.payload_hasher()  # fed as the stored bytes land: no second pass
    pool = _pool_for(client, name)
    conn = pool.get_connection()
    try:
        length = get_into(conn, name, memoryview(head), place, hasher.update)
    except ValueError as exc:
        raise CorruptRecord(str(exc)) from exc
    except (MovedError, AskError):
        # The slot moved (cluster resharding): let redis-py follow the redirect.
        return _read_via_client(client, key, name, fingerprint, out)
    finally:
        pool.release(conn)
    if length is None:
        return None
    header, stored = found[0]
    record_reads.finish_read(header, hasher.digest(), stored, out, fingerprint.layout)
    return header.num_tokens


def _read_via_client(
    client: Any, key: ChunkKey, name: bytes, fingerprint: Fingerprint, out: torch.Tensor
) -> int | None:
    value = client.get(name)
    if value is None:
        return None
    return record_reads.decode_record_into(value, fingerprint, key, out)


def send_record(
    client: Any, name: bytes, parts: list[bytes | memoryview], set_options: Sequence[bytes]
) -> None:
    """``SET name`` to the joined ``parts`` (header, then the stored payload), sent as they
    are; ``set_options``: ``(b"PX", milliseconds)`` for an expiry, or empty."""
    pool = _pool_for(client, name)
    conn = pool.get_connection()
    try:
        set_parts(conn, name, parts, set_options)
    except (MovedError, AskError):
        client.set(name, b"".join(parts), px=_px(set_options))
    finally:
        pool.release(conn)


def scan_matching(client: Any, pattern: bytes) -> list[bytes]:
    """Every name matching ``pattern``, on every master."""
    return [
        n for server in _servers(client) for n in server.scan_iter(match=pattern, count=SCAN_BATCH)
    ]


def unlink_each(client: Any, names: Sequence[bytes]) -> list[bool]:
    """``UNLINK`` each name (one per name: a cluster refuses multi-key commands across
    slots), pipelined per master in batches; True where the name existed."""
    answers = [False] * len(names)
    for server, indexes in _by_master(client, names):
        for start in range(0, len(indexes), SCAN_BATCH):
            batch = indexes[start : start + SCAN_BATCH]
            pipe = server.pipeline(transaction=False)
            for i in batch:
                pipe.unlink(names[i])
            for i, reply in zip(batch, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(reply, MovedError | AskError):  # the slot moved: follow it
                    reply = client.unlink(names[i])
                elif isinstance(reply, Exception):
                    raise reply
                answers[i] = bool(reply)
    return answers


def server_usage(client: Any) -> TierUsage:
    """``used_memory``, ``maxmemory`` (or the host's memory when unlimited) and ``DBSIZE``,
    summed over the masters."""
    used = capacity = entries = 0
    for server in _servers(client):
        info = server.info("memory")
        used += int(info.get("used_memory", 0))
        capacity += int(info.get("maxmemory", 0)) or int(info.get("total_system_memory", 0))
        entries += int(server.dbsize())
    return TierUsage(used, max(capacity, used), entries)


def _pool_for(client: Any, name: bytes) -> Any:
    """The connection pool of the server that holds ``name``."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(name)  # type: ignore[no-untyped-call]
        return client.get_redis_connection(node).connection_pool
    return client.connection_pool


def _cluster_exists(client: RedisCluster, names: Sequence[bytes]) -> list[Any]:
    """EXISTS for each name: one plain pipeline per master, not redis-py's cluster pipeline.

    On a timeout the cluster pipeline re-sends each failed command alone on a fresh
    connection, so a paused master cost ``blocking_timeout_secs`` once per key it holds (6 s
    for a lookup of 8 chunks with a 1 s timeout); a plain pipeline costs it once. Replies
    redirected by a moving slot (resharding) are asked again through the cluster client,
    which follows the redirect."""
    answers: list[Any] = [0] * len(names)
    redirected: list[int] = []
    for server, indexes in _by_master(client, names):
        pipe = server.pipeline(transaction=False)
        for i in indexes:
            pipe.exists(names[i])
        for i, reply in zip(indexes, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, MovedError | AskError):
                redirected.append(i)
            elif isinstance(reply, Exception):
                raise reply
            else:
                answers[i] = reply
    for i in redirected:
        answers[i] = client.exists(names[i])
    return answers


def _by_master(client: Any, names: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
    """The positions of ``names`` grouped by the master holding each, with a plain client
    of that master (the client itself, all positions, for a single server)."""
    if not isinstance(client, RedisCluster):
        return [(client, list(range(len(names))))]
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, name in enumerate(names):
        node = client.get_node_from_key(name)  # type: ignore[no-untyped-call]
        by_node.setdefault(node.name, (node, []))[1].append(i)
    return [(client.get_redis_connection(node), idx) for node, idx in by_node.values()]


def _servers(client: Any) -> list[Any]:
    """One plain client per master (the client itself for a single server)."""
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(node) for node in client.get_primaries()]  # type: ignore[no-untyped-call]
    return [client]


def _px(options: Sequence[bytes]) -> int | None:
    return int(options[1]) if options else None
