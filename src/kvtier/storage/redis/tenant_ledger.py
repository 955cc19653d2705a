"""Per-tenant ledgers in Redis itself: what bounds a tenant fleet-wide in a shared store.

Every engine of a fleet writes the same Redis, so a tenant's share cannot be counted in any
one of them. Each (model fingerprint, tenant) has a sorted set beside the chunks::

    name     kvtier-tenant:<fingerprint hex, TP rank 0>:<tenant, UTF-8, hex>   ("": nothing)
    members  <fingerprint hex>:<chunk key hex>    (the chunk's Redis name: kvtier:<member>)
    score    the server's clock (TIME, microseconds) when the member was last added

The TP ranks of one model share a ledger (the ranks of a world write chunks of one size, and
a share of Redis is of all of it, as each rank's CPU tier is bounded within its own memory).

The name's prefix is not the chunks' (``kvtier:<fp>:``), so the tier's ``clear`` (a SCAN of that
pattern) never takes a ledger for a chunk. After a chunk's record is SET, :func:`update`
runs one script on the ledger's server, atomically::

    ZADD ledger <now> member                    (a chunk stored again moves to the newest)
    PEXPIRE ledger <ttl>                        (remote_ttl_secs: a ledger outlives no chunk)
    while ZCARD ledger > limit:                 (limit: the tenant's quota in whole chunks)
        oldest = ZPOPMIN ledger
        DEL kvtier:<oldest>                     (one server: in the script; a cluster: after)
    -> (ZCARD ledger, members deleted, members whose chunk was already gone)

A cluster refuses a script over keys in other slots, so there the script only pops (the
ledger is one key, one slot: still atomic, two engines never pop the same member) and the
popped chunks are UNLINKed on their masters afterwards, one pipeline per master; the
look-ahead below is an EXISTS pipeline and a script that removes a member only if its score
is still the one read.

Why the count can only err low: a member is added after its chunk is stored, and popped
before its chunk is deleted. Redis' own eviction (maxmemory) and expiry delete chunks without
touching the ledger, leaving *stale* members: the ledger then counts more than the tenant
holds, so the tenant holds less than its limit, never more. A stale member costs nothing
live when it is the oldest (a pop takes it first; counted as stale, not as an eviction), and
when a pop finds one gone, the next :data:`PRUNE_AHEAD` oldest are checked and
the stale ones dropped, so an expiry wave does not leave the tenant short for long.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import AskError, MovedError, ResponseError

LEDGER_PREFIX = b"kvtier-tenant:"
CHUNK_PREFIX = b"kvtier:"  # a chunk's Redis name is this and its ledger member
PRUNE_AHEAD = 16  # oldest members checked for staleness when a pop found one gone

# KEYS[1] ledger; ARGV: member ('' none), limit (-1 none), chunk name prefix, ttl ms (0 none),
# '1' to DEL popped chunks here (one server) or '0' to return them (a cluster).
# Returns {members now, deleted (or popped) members, stale members found}.
_UPDATE = """
local ledger, member, limit = KEYS[1], ARGV[1], tonumber(ARGV[2])
local prefix, ttl, here = ARGV[3], tonumber(ARGV[4]), ARGV[5] == '1'
if member ~= '' then
  local now = redis.call('TIME')
  redis.call('ZADD', ledger, tonumber(now[1]) * 1000000 + tonumber(now[2]), member)
  if ttl > 0 then redis.call('PEXPIRE', ledger, ttl) end
end
local out, stale = {}, 0
if limit >= 0 then
  local over = redis.call('ZCARD', ledger) - limit
  if over > 0 then
    local popped = redis.call('ZPOPMIN', ledger, over)
    for i = 1, #popped, 2 do
      if not here or redis.call('DEL', prefix .. popped[i]) == 1 then
        out[#out + 1] = popped[i]
      else
        stale = stale + 1
      end
    end
    if stale > 0 then
      for _, m in ipairs(redis.call('ZRANGE', ledger, 0, tonumber(ARGV[6]) - 1)) do
        if redis.call('EXISTS', prefix .. m) == 0 then
          redis.call('ZREM', ledger, m)
          stale = stale + 1
        end
      end
    end
  end
end
return {redis.call('ZCARD', ledger), out, stale}
"""


# KEYS[1] ledger; ARGV: member, score, member, score...: each removed if its score is that one.
_REMOVE_IF_SCORE = """
local removed = 0
for i = 1, #ARGV, 2 do
  if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i])) == tonumber(ARGV[i + 1]) then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return removed
"""


@dataclass(frozen=True, slots=True)
class LedgerUpdate:
    chunks: int  # members the ledger holds now
    evicted: list[bytes]  # members whose chunk this update deleted
    stale: int  # members dropped because their chunk was gone already


def ledger_name(fingerprint_hex: str, tenant: str) -> bytes:
    """The ledger of ``tenant``'s chunks under one fingerprint (module docstring)."""
    return LEDGER_PREFIX + fingerprint_hex.encode() + b":" + tenant.encode().hex().encode()


def update(
    client: Any,
    ledger: bytes,
    member: bytes | None,
    limit: int | None,
    chunk_prefix: bytes,
    ttl_ms: int = 0,
) -> LedgerUpdate:
    """Add ``member`` (None: add nothing, only enforce) and bring the ledger down to
    ``limit`` members (None: no limit), deleting the popped chunks (module docstring).
    Raises redis-py's errors (``ResponseError`` where scripting is refused)."""
    cluster = isinstance(client, RedisCluster)
    args = [
        member or b"",
        -1 if limit is None else limit,
        chunk_prefix,
        ttl_ms,
        b"0" if cluster else b"1",
        PRUNE_AHEAD,
    ]
    chunks, popped, stale = client.eval(_UPDATE, 1, ledger, *args)
    popped = [bytes(m) for m in popped]
    if not cluster or not popped:
        return LedgerUpdate(int(chunks), popped, int(stale))
    deleted = _unlink_each(client, [chunk_prefix + m for m in popped])
    evicted = [m for m, gone in zip(popped, deleted, strict=True) if gone]
    stale = len(popped) - len(evicted)
    if stale:
        pruned = _prune_ahead(client, ledger, chunk_prefix)
        chunks, stale = int(chunks) - pruned, stale + pruned
    return LedgerUpdate(int(chunks), evicted, stale)


def _prune_ahead(client: RedisCluster, ledger: bytes, chunk_prefix: bytes) -> int:
    """On a cluster, what the script does on one server when a pop found a chunk gone: the
    next :data:`PRUNE_AHEAD` oldest members whose chunks are gone leave the ledger. A member
    is removed only if its score is still the one read (a store of the same chunk by another
    engine since then re-added it, live). Returns how many left."""
    oldest: list[tuple[bytes, float]] = list(
        client.zrange(ledger, 0, PRUNE_AHEAD - 1, withscores=True)  # type: ignore[arg-type]
    )
    if not oldest:
        return 0
    held = _exists_each(client, [chunk_prefix + bytes(m) for m, _ in oldest])
    gone = [(bytes(m), repr(score)) for (m, score), h in zip(oldest, held, strict=True) if not h]
    if not gone:
        return 0
    args = [part for pair in gone for part in pair]
    return int(client.eval(_REMOVE_IF_SCORE, 1, ledger, *args))


def update_without_scripts(
    client: Any,
    ledger: bytes,
    member: bytes | None,
    limit: int | None,
    chunk_prefix: bytes,
    ttl_ms: int = 0,
) -> LedgerUpdate:
    """:func:`update` where the server refuses scripts (some managed services): one
    MULTI/EXEC on the ledger's master adds the member (scored by this host's clock: engines'
    clocks order the fleet's stores, to within their skew), reads the members past the
    newest ``limit`` and removes them, still atomically (two engines never pop the same
    member); their chunks are then unlinked, master by master. No look-ahead pruning."""
    server = client
    if isinstance(client, RedisCluster):
        server = client.get_redis_connection(client.get_node_from_key(ledger))  # type: ignore[no-untyped-call]
    pipe = server.pipeline(transaction=True)
    if member:
        pipe.zadd(ledger, {member: time.time_ns() // 1000})
        if ttl_ms:
            pipe.pexpire(ledger, ttl_ms)
    if limit is not None:
        pipe.zrange(ledger, 0, -(limit + 1))
        pipe.zremrangebyrank(ledger, 0, -(limit + 1))
    pipe.zcard(ledger)
    replies = pipe.execute()
    popped = [bytes(m) for m in replies[-3]] if limit is not None else []
    if not popped:
        return LedgerUpdate(int(replies[-1]), [], 0)
    names = [chunk_prefix + m for m in popped]
    if isinstance(client, RedisCluster):
        deleted = _unlink_each(client, names)
    else:
        unlink = client.pipeline(transaction=False)
        for name in names:
            unlink.unlink(name)
        deleted = [bool(n) for n in unlink.execute()]
    evicted = [m for m, gone in zip(popped, deleted, strict=True) if gone]
    return LedgerUpdate(int(replies[-1]), evicted, len(popped) - len(evicted))


def scripts_refused(exc: ResponseError) -> bool:
    """Whether ``exc`` says the server (or this user's ACL) does not run scripts at all, as
    opposed to this one call failing (out of memory, a slot moving)."""
    text = str(exc).lower()
    return "unknown command" in text or "noperm" in text


def counts(client: Any, ledgers: Sequence[bytes]) -> list[int]:
    """``ZCARD`` of each ledger, in one pipeline (redis-py's cluster pipeline on a cluster:
    a ledger is one key, so each command goes to its master)."""
    if not ledgers:
        return []
    pipe = client.pipeline(transaction=False)
    for ledger in ledgers:
        pipe.zcard(ledger)
    return [int(n) for n in pipe.execute()]


def _unlink_each(client: RedisCluster, names: Sequence[bytes]) -> list[bool]:
    """UNLINK each name on its master (one plain pipeline per master): whether each went."""
    return _each(client, names, "unlink")


def _exists_each(client: RedisCluster, names: Sequence[bytes]) -> list[bool]:
    return _each(client, names, "exists")


def _each(client: RedisCluster, names: Sequence[bytes], command: str) -> list[bool]:
    """``command name`` for each name on its master (one plain pipeline per master, as
    :func:`kvtier.storage.redis.commands.exists_pipelined` does): each reply as a bool."""
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, name in enumerate(names):
        node = client.get_node_from_key(name)  # type: ignore[no-untyped-call]
        by_node.setdefault(node.name, (node, []))[1].append(i)
    gone = [False] * len(names)
    for node, indexes in by_node.values():
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        for i in indexes:
            getattr(pipe, command)(names[i])
        for i, reply in zip(indexes, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, MovedError | AskError):  # the slot moved: follow it
                reply = getattr(client, command)(names[i])
            elif isinstance(reply, Exception):
                raise reply
            gone[i] = bool(reply)
    return gone
