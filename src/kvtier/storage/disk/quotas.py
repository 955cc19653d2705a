"""The disk tier under ``tenant_quotas``: its index's policy per tenant, and what survives.

With quotas the index's policy is the tier's ledger, a
:class:`~kvtier.storage.tenants.local.TenantPolicy` over the engine's one quota table (the
CPU tier reads the same table). Its unit is the file of one whole chunk (header + payload
as the identity codec writes it: with another codec a chunk is still charged as one unit),
its capacity the directory's ``max_local_disk_size``.
A put names its tenant to the ledger as it is queued (``TenantPolicy.expect``: the index
inserts the key only when the write lands); once it landed the tier charges it
(:meth:`DiskQuotas.charge`), and while its tenant is over its limit the tenant's own unpinned
files go.

What a restart keeps, in ``.<fp16hex>.tenants`` beside the saved index (JSON, written to a
temporary name, fsynced and renamed, like the index)::

    {"quotas": {tenant: "25%" | "2.00 GiB" | null}, "chunks": {tenant: [key hex, ...]}}

``quotas`` holds the rows set at run time (``PUT /quota``; null: removed), saved at each
change and applied over the config's ``tenant_quotas`` at the next open, so a limit set
through the admin API outlives the process while a row only the config names follows the
config. ``chunks`` (saved at a clean close) gives the files their tenants back; a file it
does not name (written after a crash) counts as the unsalted tenant's. A file that is
missing, unreadable or not this format (not JSON, nested past the parser's stack, the wrong
shapes) is ignored with one warning: quotas start from the config, as on a first open. One
row that does not parse (a limit out of range, as an older kvtier saved from LMCache's alias)
is dropped with one warning naming it; the other rows and the chunks' tenants still apply.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from kvtier.config.tenant_quotas import TenantLimit, check_tenant, parse_limit
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.storage.disk.snapshot import replace_file
from kvtier.storage.disk.state import DiskState
from kvtier.storage.policy import make_policy
from kvtier.storage.tenants.ledger import NO_SALT
from kvtier.storage.tenants.local import TenantPolicy
from kvtier.storage.tenants.quotas import TenantQuotas

log = logging.getLogger(__name__)

SUFFIX = ".tenants"


def tenants_name(fp_hex: str) -> str:
    return f".{fp_hex}{SUFFIX}"


class DiskQuotas:
    """A disk tier's side of the quota table: its index's policy, the saved file, and a
    row changed at run time applied (and saved) at once. Made before the tier opens."""

    def __init__(self, state: DiskState, quotas: TenantQuotas, unit_bytes: int) -> None:
        self._state = state
        cache_policy = state.options.cache_policy
        self.policy = TenantPolicy(
            lambda: make_policy(cache_policy), quotas, unit_bytes, state.options.capacity_bytes
        )
        state.index.policy = self.policy  # the index is empty until the open builds it
        state.quotas = self
        self._bind()

    def _bind(self) -> None:
        """The ledger's victims are unpinned files, taken under the state's lock (the tier's
        own until open, then its directory's: bound again at open)."""
        index = self._state.index
        self.policy.bind(lambda key: not index.is_pinned(key), self._state.lock)

    def expect(self, key: ChunkKey, tenant: str) -> None:
        """Under the lock: a put of ``tenant`` was queued; its key is the tenant's when it
        lands (the index inserts it then)."""
        self.policy.expect(key, tenant)

    def charge(self, key: ChunkKey) -> list[ChunkKey]:
        """Under the lock: ``key`` landed (the index holds it, as :meth:`expect` named it);
        its tenant's own victims while over its limit, taken out of the index (the caller
        unlinks their files and reports them)."""
        victims = self.policy.charge(key, NO_SALT)  # charged already: NO_SALT goes unused
        self._state.index.forget(victims)
        return victims

    def load(self, dir_fd: int) -> None:
        """At open, before the index is built: the saved rows and chunks' tenants."""
        load(dir_fd, self._state.fp_hex, self.policy)

    def loaded(self) -> None:
        """At open, once the index is built: the open listens for changes from now on."""
        self.policy.forget_expected()
        self._bind()
        self.policy.quotas.subscribe(self.changed)

    def changed(self) -> None:
        """A row changed (``PUT /quota``): tenants move between orders, those now over their
        limit drop their own files, and the rows are saved for the next open."""
        state = self._state
        with state.lock:
            if state.dir.lost or state.dir.fd < 0:
                return
            victims = self.policy.regroup()
            state.index.forget(victims)
            if victims:
                state.unlink(victims)
                state.counters.evicted += len(victims)
            self._save_quietly()
        if victims:
            state.owner.report_evicted(victims)

    def close(self, *, save: bool) -> None:
        """At close, under the lock: no more changes heard; when ``save`` (a clean close),
        the rows and every file's tenant saved."""
        self.policy.quotas.unsubscribe(self.changed)
        if save and not self._state.dir.lost:
            self._save_quietly()

    def _save_quietly(self) -> None:
        state = self._state
        try:
            save(state.dir.fd, state.fp_hex, self.policy, list(state.index.key_set()))
        except OSError as exc:
            log.warning("disk tier %s: quotas not saved (%s)", state.options.path, exc)


def load(dir_fd: int, fp_hex: str, policy: TenantPolicy) -> None:
    """Apply a saved file (module docstring): its run-time rows over the table, its chunks'
    tenants to the index rows added next. Before the index is built; never raises."""
    name = tenants_name(fp_hex)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("disk tier quotas %s unreadable (%s): quotas from the config", name, exc)
        return
    try:
        with os.fdopen(fd, "rb") as f:
            saved = json.loads(f.read())  # ValueError (UnicodeDecodeError too), RecursionError
        raw_rows = saved.get("quotas", {})
        if not isinstance(raw_rows, dict):
            raise ValueError("quotas is not a mapping")
        chunks = {
            bytes.fromhex(key): check_tenant("tenant", tenant)
            for tenant, keys in saved.get("chunks", {}).items()
            for key in keys
        }
    except (OSError, ValueError, RecursionError, AttributeError, TypeError, ConfigError) as exc:
        log.warning("disk tier quotas %s ignored (%s): quotas from the config", name, exc)
        return
    for tenant, raw in raw_rows.items():
        try:
            limit = _row(tenant, raw)
        except ConfigError as exc:
            log.warning(
                "disk tier quotas %s: saved row %r dropped (%s): its limit is the config's",
                name,
                tenant,
                exc,
            )
            continue
        policy.quotas.set(tenant, limit)
    policy.expect_many(chunks)


def save(dir_fd: int, fp_hex: str, policy: TenantPolicy, keys: Sequence[ChunkKey]) -> None:
    """Write the run-time rows and the tenants of ``keys`` (the index's); raises OSError."""
    chunks: dict[str, list[str]] = {}
    for key in keys:
        tenant = policy.tenant_of(key)
        if tenant is not None:
            chunks.setdefault(tenant, []).append(key.hex())
    overrides = policy.quotas.overrides()
    rows = {t: None if q is None else q.spec() for t, q in overrides.items()}
    data = json.dumps({"quotas": rows, "chunks": chunks}).encode()
    replace_file(dir_fd, tenants_name(fp_hex), data, 0o600)


def _row(tenant: object, raw: object) -> TenantLimit | None:
    """One saved row (None: removed at run time); :class:`ConfigError` when it does not parse."""
    check_tenant("tenant", tenant)
    return None if raw is None else parse_limit(f"quotas[{tenant!r}]", raw)
