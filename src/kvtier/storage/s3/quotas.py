"""The s3 tier's tenant ledger under ``tenant_quotas`` (the protocol:
:mod:`kvtier.storage.remote.ledger`): a cap per tenant across the fleet, as of each engine's
last listing.

An object store has no atomic scripting, and a listing of the chunks names no tenant. So
each stored chunk also gets an empty *marker* object that names its tenant, in a prefix of
its own beside the chunks::

    chunk   <prefix>/<fp hex>/<key hex>
    marker  <prefix>/<fp hex, TP rank 0>.tenants/<tenant dir>/<fp hex>.<key hex>   (empty;
            written after the chunk: it names the chunk, whichever TP rank wrote it)
    tenant dir   't' + the tenant's UTF-8 in hex ('t' alone: no salt), or 'h' + a
                 BLAKE2b-128 hex digest when that would pass 512 characters (S3 keys are at
                 most 1,024 bytes); such a tenant is matched to its row by the same digest.
                 A salt the table does not name is counted under "*" (``counted_as``): one
                 directory and one order for all of them, capped together by the row

The TP ranks of one model share the markers' prefix, so a tenant's limit is of all their
chunks (as in the Redis tier). Every engine lists the markers with the chunks (at open and
every ``s3_list_interval_secs``) and so knows each tenant's chunks across the fleet, oldest
first (by the marker's last-modified time, then name), plus what it stored itself since.
After a write of a tenant over its limit, that engine deletes the tenant's oldest, chunk
and marker, whichever engine stored them (one ``DeleteObjects``)::

    charge        -> marker PUT (if it fails, the tier deletes the chunk again: nothing
                     uncounted); the tenant's order gets the key; while it holds more than
                     its limit, its oldest go, chunk and marker
    listing       -> the orders become what the markers say, plus this engine's writes and
                     less its deletions since the listing began
    enforce_all   -> every tenant this engine knows brought within its new limit at once
                     (PUT /quota)

How far it holds: another engine's writes since this engine's last listing are not in its
order, so the fleet can hold a tenant's limit plus what the other engines stored for it
within one listing interval; the next store after a listing brings it back to its limit. A
restarted engine counts what the fleet stored before (the markers outlive it). A marker whose
chunk is gone (a lifecycle rule, ``clear``) is stale: the tenant holds less than counted,
never more, and a pop that takes it deletes only a marker. A share (``"25%"``) has nothing to
be a share of: an object store reports no capacity, so share rows do not bind this tier (one
warning at open names them: ``opened``); byte rows do. Each engine reports
``quota_evictions`` for the chunks it deleted (two engines with the same stale view may
delete the same one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable

from kvtier.errors import TierError
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.storage.remote.ledger import QuotaLedger
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.index import ChunkIndex, chunk_key_of
from kvtier.storage.tenants.quotas import TenantQuotas

log = logging.getLogger(__name__)

MAX_DIR_HEX = 512  # a tenant's dir in hex up to this; a digest beyond


def tenant_dir(tenant: str) -> str:
    """The marker directory of ``tenant`` (module docstring)."""
    hexed = tenant.encode().hex()
    if len(hexed) <= MAX_DIR_HEX:
        return "t" + hexed
    return "h" + hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest()


class S3Ledger(QuotaLedger):
    """Thread-safe: writer threads charge, the lister relists, the admin thread enforces."""

    def __init__(
        self,
        quotas: TenantQuotas,
        unit_bytes: int,
        read_capacity: Callable[[], int],
        *,
        index: ChunkIndex,
        client: S3Client,
        base: str,
        fingerprint: Fingerprint,
    ) -> None:
        """``base``: the objects' prefix with its '/' ('' for none); ``fingerprint``: the
        tier's (its chunks are ``<base><fingerprint hex>/<key hex>``)."""
        super().__init__(quotas, unit_bytes, read_capacity)
        self._index = index
        self._client = client
        self._base = base
        self._fp_hex = fingerprint.hex()
        rank0 = dataclasses.replace(fingerprint, tp_rank=0).hex()  # the ranks share it
        self.marker_prefix = f"{base}{rank0}.tenants/"
        # Per tenant, its chunks as members "<fp hex>.<key hex>", oldest first.
        self._orders: dict[str, OrderedDict[str, None]] = {}
        self._dirs: dict[str, str] = {}  # tenant dir -> tenant, for every tenant seen
        # While a listing runs: what this engine stored (member -> tenant) and deleted since.
        self._listing = False
        self._added: dict[str, str] = {}
        self._removed: set[str] = set()

    def member(self, key: ChunkKey) -> str:
        return f"{self._fp_hex}.{key.hex()}"

    def marker_name(self, tenant: str, member: str) -> str:
        return f"{self.marker_prefix}{tenant_dir(tenant)}/{member}"

    def _chunk_name(self, member: str) -> str:
        fp_hex, _, key_hex = member.partition(".")
        return f"{self._base}{fp_hex}/{key_hex}"

    def _own_key(self, member: str) -> ChunkKey | None:
        """The chunk key of ``member`` when this tier wrote it (its fingerprint), else None."""
        fp_hex, _, key_hex = member.partition(".")
        return bytes.fromhex(key_hex) if fp_hex == self._fp_hex else None

    def limit_bytes(self, tenant: str) -> int | None:
        """Byte rows only: a share of an object store has no capacity to be a share of."""
        limit = self.quotas.limit(tenant)
        return None if limit is None or limit.nbytes is None else limit.nbytes

    def opened(self) -> None:
        """One warning naming the share rows: they do not bound this tier."""
        shares = sorted(t for t, limit in self.quotas.rows().items() if limit.share is not None)
        if shares:
            log.warning(
                "s3 tier: tenant_quotas rows %s are shares, and an object store has no "
                "capacity to take a share of: they do not bound this tier (give a size, "
                "e.g. '20GiB')",
                shares,
            )

    # -- stores and enforcement -----------------------------------------------------------
    def charge(self, key: ChunkKey, tenant: str) -> list[ChunkKey]:
        """``key``'s chunk of ``tenant`` is written: its marker is written, the order it is
        counted in gets it, and the tenant's oldest past its limit are deleted, chunk and
        marker, whichever engine stored them. Returns the deleted chunks this tier's index
        held. Raises TierError when the marker was not written (nothing counted)."""
        tenant = self.counted_as(tenant)
        member = self.member(key)
        self._client.put(self.marker_name(tenant, member), b"")
        with self._lock:
            self._dirs[tenant_dir(tenant)] = tenant
            order = self._orders.setdefault(tenant, OrderedDict())
            order[member] = None
            order.move_to_end(member)  # stored again: the newest
            if self._listing:
                self._added[member] = tenant
                self._removed.discard(member)
        return self._drop(self._trim(tenant))

    def enforce_all(self) -> list[ChunkKey]:
        """Every tenant within its limit now (a row changed); returns what :meth:`charge`
        returns."""
        victims: list[tuple[str, str]] = []
        for tenant in list(self._orders):
            victims += self._trim(tenant)
        return self._drop(victims)

    def _trim(self, tenant: str) -> list[tuple[str, str]]:
        """Pop ``tenant``'s oldest members past its limit: (tenant, member) each."""
        limit = self.limit_chunks(tenant)
        popped: list[tuple[str, str]] = []
        with self._lock:
            order = self._orders.get(tenant, OrderedDict())
            while limit is not None and len(order) > limit:
                member, _ = order.popitem(last=False)
                popped.append((tenant, member))
                if self._listing:
                    self._removed.add(member)
                    self._added.pop(member, None)
            chunks = len(order)
        own = [key for _, m in popped if (key := self._own_key(m)) is not None]
        evicted = [key for key, h in zip(own, self._index.contains(own), strict=True) if h]
        others = len(popped) - len(own)  # another TP rank's: this index cannot say if gone
        self.updated(tenant, chunks, evicted, len(own) - len(evicted), others=others)
        return popped

    def _drop(self, popped: list[tuple[str, str]]) -> list[ChunkKey]:
        """Delete each popped chunk and its marker; this tier's own leave the index whether
        or not the store answered (a chunk left behind is no longer counted: a lifecycle rule
        or ``clear`` takes it). Returns this tier's popped chunks the index held."""
        names = [self._chunk_name(m) for _, m in popped]
        names += [self.marker_name(t, m) for t, m in popped]
        try:
            self._client.delete(names)
        except TierError as exc:
            log.warning("s3 tier: chunks over their tenant's quota not deleted: %s", exc)
        keys = [key for _, m in popped if (key := self._own_key(m)) is not None]
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
            directory, _, member = name[len(self.marker_prefix) :].partition("/")
            by_dir.setdefault(directory, []).append((stamp, member))
        with self._lock:
            orders: dict[str, OrderedDict[str, None]] = {}
            for directory, entries in by_dir.items():
                tenant = self._tenant_of_dir(directory)
                if tenant is None:
                    continue
                order = orders[tenant] = OrderedDict()
                for _, member in sorted(entries):
                    if _is_member(member) and member not in self._removed:
                        order[member] = None
            for member, tenant in self._added.items():  # written since it began: the newest
                orders.setdefault(tenant, OrderedDict())[member] = None
                orders[tenant].move_to_end(member)
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


def _is_member(name: str) -> bool:
    """Whether a marker's name is ``<fp hex>.<key hex>`` (anything else is not kvtier's)."""
    fp_hex, dot, key_hex = name.partition(".")
    try:
        bytes.fromhex(fp_hex)
    except ValueError:
        return False
    return bool(dot and fp_hex) and chunk_key_of("", key_hex) is not None
