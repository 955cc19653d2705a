"""The s3 tier under ``tenant_quotas``: a cap per tenant across the fleet, as of each
engine's last listing.

An object store has no atomic scripting, and a listing of the chunks names no tenant. So
each stored chunk also gets an empty *marker* object that names its tenant, in a prefix of
its own beside the chunks::

    chunk   <prefix>/<fp hex>/<key hex>
    marker  <prefix>/<fp hex>.tenants/<tenant dir>/<key hex>      (empty; written after it)
    tenant dir   't' + the tenant's UTF-8 in hex ('t' alone: no salt), or 'h' + a
                 BLAKE2b-128 hex digest when that would pass 512 characters (S3 keys are at
                 most 1,024 bytes); such a tenant is matched to its row by the same digest

Every engine lists the markers with the chunks (at open and every ``s3_list_interval_secs``)
and so knows each tenant's chunks across the fleet, oldest first (by the marker's
last-modified time, then key), plus what it stored itself since. After a write of a tenant
over its limit, that engine deletes the tenant's oldest, chunk and marker, whichever engine
stored them (one ``DeleteObjects``)::

    write landed  -> marker PUT (if it fails, the chunk is deleted again: nothing uncounted);
                     the tenant's order gets the key; while it holds more than its limit,
                     its oldest go, chunk and marker
    listing       -> the orders become what the markers say, plus this engine's writes and
                     less its deletions since the listing began
    PUT /quota    -> every tenant this engine knows brought within its new limit at once

How far it holds: another engine's writes since this engine's last listing are not in its
order, so the fleet can hold a tenant's limit plus what the other engines stored for it
within one listing interval; the next store after a listing brings it back to its limit. A
restarted engine counts what the fleet stored before (the markers outlive it). A marker whose
chunk is gone (a lifecycle rule, ``clear``) is stale: the tenant holds less than counted,
never more, and a pop that takes it deletes only a marker. A share (``"25%"``) has nothing to
be a share of: an object store reports no capacity, so share rows do not bind this tier (one
warning at open names them); byte rows do. Each engine reports ``quota_evictions`` for the
chunks it deleted (two engines with the same stale view may delete the same one).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

from kvtier.errors import TierError
from kvtier.keys import ChunkKey
from kvtier.storage.policy.quotas import TenantQuotas
from kvtier.storage.remote_quotas import RemoteQuotas
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.index import ChunkIndex, chunk_key_of

log = logging.getLogger(__name__)

MAX_DIR_HEX = 512  # a tenant's dir in hex up to this; a digest beyond


def tenant_dir(tenant: str) -> str:
    """The marker directory of ``tenant`` (module docstring)."""
    hexed = tenant.encode().hex()
    if len(hexed) <= MAX_DIR_HEX:
        return "t" + hexed
    return "h" + hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest()


class S3Quotas(RemoteQuotas):
    """Thread-safe: writer threads store, the lister relists, the admin thread enforces."""

    def __init__(
        self,
        quotas: TenantQuotas,
        unit_bytes: int,
        index: ChunkIndex,
        client: S3Client,
        chunk_prefix: str,
    ) -> None:
        super().__init__(quotas, unit_bytes)
        self._index = index
        self._client = client
        self._chunk_prefix = chunk_prefix
        self.marker_prefix = chunk_prefix.rstrip("/") + ".tenants/"
        self._orders: dict[str, OrderedDict[ChunkKey, None]] = {}  # oldest first
        self._dirs: dict[str, str] = {}  # tenant dir -> tenant, for every tenant seen
        # While a listing runs: what this engine stored (key -> tenant) and deleted since.
        self._listing = False
        self._added: dict[ChunkKey, str] = {}
        self._removed: set[ChunkKey] = set()

    def marker_name(self, tenant: str, key: ChunkKey) -> str:
        return f"{self.marker_prefix}{tenant_dir(tenant)}/{key.hex()}"

    def limit_bytes(self, tenant: str) -> int | None:
        """Byte rows only: a share of an object store has no capacity to be a share of."""
        limit = self.quotas.limit(tenant)
        return None if limit is None or limit.nbytes is None else limit.nbytes

    def warn_shares(self) -> None:
        shares = sorted(t for t, limit in self.quotas.rows().items() if limit.share is not None)
        if shares:
            log.warning(
                "s3 tier: tenant_quotas rows %s are shares, and an object store has no "
                "capacity to take a share of: they do not bound this tier (give a size, "
                "e.g. '20GiB')",
                shares,
            )

    # -- stores and enforcement -----------------------------------------------------------
    def stored(self, tenant: str, key: ChunkKey) -> None:
        """``key``'s chunk of ``tenant`` is written: its marker is written and the tenant's
        order gets it (:meth:`enforce` then trims). Raises TierError when the marker was not
        written, after deleting the chunk again (best effort), so that no chunk goes
        uncounted."""
        try:
            self._client.put(self.marker_name(tenant, key), b"")
        except TierError:
            try:
                self._client.delete([self._chunk_prefix + key.hex()])
            except TierError as exc:
                log.warning("s3 tier: uncounted chunk %s not deleted: %s", key.hex(), exc)
            raise
        with self._lock:
            self._dirs[tenant_dir(tenant)] = tenant
            order = self._orders.setdefault(tenant, OrderedDict())
            order[key] = None
            order.move_to_end(key)  # stored again: the newest
            if self._listing:
                self._added[key] = tenant
                self._removed.discard(key)

    def enforce(self, tenant: str) -> list[ChunkKey]:
        """``tenant``'s oldest over its limit deleted, chunk and marker, whichever engine
        stored them. Returns the deleted chunks this engine's index held."""
        return self._drop(self._trim(tenant))

    def enforce_all(self) -> list[ChunkKey]:
        """Every tenant within its limit now (a row changed); returns what :meth:`enforce`
        returns."""
        victims: list[tuple[str, ChunkKey]] = []
        for tenant in list(self._orders):
            victims += self._trim(tenant)
        return self._drop(victims)

    def _trim(self, tenant: str) -> list[tuple[str, ChunkKey]]:
        limit = self.limit_chunks(tenant)
        popped: list[tuple[str, ChunkKey]] = []
        with self._lock:
            order = self._orders.get(tenant, OrderedDict())
            while limit is not None and len(order) > limit:
                key, _ = order.popitem(last=False)
                popped.append((tenant, key))
                if self._listing:
                    self._removed.add(key)
                    self._added.pop(key, None)
            chunks = len(order)
        held = self._index.contains([key for _, key in popped])
        evicted = [key for (_, key), h in zip(popped, held, strict=True) if h]
        self.updated(tenant, chunks, evicted, len(popped) - len(evicted))
        return popped

    def _drop(self, popped: list[tuple[str, ChunkKey]]) -> list[ChunkKey]:
        """Delete each popped chunk and its marker; they leave the index whether or not the
        store answered (a chunk left behind is no longer counted: a lifecycle rule or
        ``clear`` takes it). Returns the popped chunks the index held."""
        names = [self._chunk_prefix + k.hex() for _, k in popped]
        names += [self.marker_name(t, k) for t, k in popped]
        try:
            self._client.delete(names)
        except TierError as exc:
            log.warning("s3 tier: chunks over their tenant's quota not deleted: %s", exc)
        keys = [key for _, key in popped]
        held = self._index.contains(keys)
        self._index.discard_many(keys)
        return [key for key, h in zip(keys, held, strict=True) if h]

    # -- listings ---------------------------------------------------------------------------
    def relist(self) -> None:
        """List the markers and make each tenant's order what the fleet holds (module
        docstring). Raises TierError when the store did not answer (the orders stay)."""
        with self._lock:
            self._listing = True
            self._added, self._removed = {}, set()
        try:
            listed = list(self._client.list_dated(self.marker_prefix))
        except BaseException:
            with self._lock:
                self._listing = False
            raise
        by_dir: dict[str, list[tuple[float, str]]] = {}
        for name, stamp in listed:
            directory, _, key_hex = name[len(self.marker_prefix) :].partition("/")
            by_dir.setdefault(directory, []).append((stamp, key_hex))
        with self._lock:
            orders: dict[str, OrderedDict[ChunkKey, None]] = {}
            for directory, entries in by_dir.items():
                tenant = self._tenant_of_dir(directory)
                if tenant is None:
                    continue
                order = orders[tenant] = OrderedDict()
                for _, key_hex in sorted(entries):
                    key = chunk_key_of("", key_hex)
                    if key is not None and key not in self._removed:
                        order[key] = None
            for key, tenant in self._added.items():  # written since it began: the newest
                orders.setdefault(tenant, OrderedDict())[key] = None
                orders[tenant].move_to_end(key)
            self._orders = orders
            self._listing = False
            self._added, self._removed = {}, set()
            counts = {tenant: len(order) for tenant, order in orders.items()}
        for tenant, chunks in counts.items():
            self.updated(tenant, chunks, ())

    def _tenant_of_dir(self, directory: str) -> str | None:
        """The tenant a marker directory names: decoded, or a digest matched to a tenant
        seen here or a row; None for a name that is not a marker directory."""
        if directory.startswith("t"):
            try:
                tenant = bytes.fromhex(directory[1:]).decode()
            except ValueError:
                return None
            self._dirs[directory] = tenant
            return tenant
        if directory.startswith("h") and directory not in self._dirs:
            for tenant in self.quotas.rows():
                self._dirs[tenant_dir(tenant)] = tenant
        return self._dirs.get(directory, directory if directory.startswith("h") else None)
