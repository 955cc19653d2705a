"""Every error kvtier raises on purpose.

The hierarchy, so a caller can catch as narrowly or as broadly as it needs::

    KVTierError
    ├── ConfigError            a config key has a bad value (names key, value, what is allowed)
    ├── InputError             bad arguments to a public call (tokens, KV shape/dtype, request id)
    ├── StateError             the object is not open, or already closed
    ├── CapacityError          a request cannot fit even after eviction (never raised by store:
    │                          a store that does not fit is dropped and counted instead)
    ├── TierError              a storage tier failed (I/O, server, corrupt record)
    │   ├── TierUnavailable    the tier is down (server unreachable, disk gone)
    │   └── CorruptRecord      bytes failed their checksum or header check
    │       └── UnknownRecordFormat  an intact-looking record of another format version
    │                                or payload codec than this kvtier reads
    └── TransferError          a prefill/decode transfer failed
        ├── ProtocolError      a malformed, oversized or unexpected control message
        ├── AuthError          the peer could not prove it knows the shared secret
        └── TransferTimeout    the peer did not answer in time (buffer full, peer stalled)

Third-party errors (``OSError``, redis, socket) are translated into these where they enter
kvtier, so nothing foreign leaks out of a public call.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A config value is invalid. The message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"config key {key!r} has invalid value {value!r}: {allowed}")


class InputError(KVTierError, ValueError):
    """A public call got arguments it cannot use."""


class StateError(KVTierError, RuntimeError):
    """The object is in the wrong lifecycle state (not opened yet, or closed)."""


class CapacityError(KVTierError):
    """The request cannot be served with the memory available, even after eviction."""


class TierError(KVTierError):
    """A storage tier failed."""


class TierUnavailable(TierError):
    """The tier cannot be reached right now (server down or stalled, disk gone)."""


class CorruptRecord(TierError):
    """Stored bytes failed their header or checksum check; the entry is treated as a miss."""


class UnknownRecordFormat(CorruptRecord):
    """A record this kvtier cannot read: another format version, or a payload codec id not
    registered here (kvtier.storage.codecs). A miss like any corrupt record; tiers log it
    once rather than per chunk, since it comes in crowds (after an upgrade)."""


class TransferError(KVTierError):
    """A prefill/decode KV transfer failed."""


class ProtocolError(TransferError):
    """A control message was malformed, oversized, of an unknown version or unexpected."""


class AuthError(TransferError):
    """A peer failed kvtier's handshake (:mod:`kvtier.trust`): it has no token, or another one."""


class TransferTimeout(TransferError):
    """The peer did not answer in time (receive buffer full, peer stalled or gone)."""
