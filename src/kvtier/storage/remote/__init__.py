"""One remote tier over any shared store (Redis, S3, the next one), written once.

A new remote store is four small pieces and one registry line::

    store.py    ObjectStore     the store's names and calls (get into, put, exists many,
                                delete many, list keys, usage) and whether it is away
    ledger.py   QuotaLedger     its tenant ledger under ``tenant_quotas`` (refusal,
                                charge -> victims, enforce_all), over RemoteQuotas
    options     put_threads, inflight_bytes (and whatever the store reads itself)
    registry    register_tier("remote_url", scheme, factory)

and :class:`~kvtier.storage.remote.tier.RemoteTier` does the rest: the write queue, the
record and its codec, the outage window (:mod:`.outage`), pins (:mod:`.pins`), membership
events, counters and the tenant hooks. ``storage/redis/`` and ``storage/s3/`` are the two
stores so far.
"""

from kvtier.storage.remote.ledger import LedgerFactory, QuotaLedger
from kvtier.storage.remote.store import ObjectStore, RemoteCounters
from kvtier.storage.remote.tier import RemoteTier

__all__ = ["LedgerFactory", "ObjectStore", "QuotaLedger", "RemoteCounters", "RemoteTier"]
