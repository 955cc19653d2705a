"""Keeping the s3 tier's index what its prefix holds: one listing at open, then one every
``s3_list_interval_secs``, on a thread of its own (``kvtier-s3-lister``).

Each listing (:meth:`PrefixLister.refresh`) lists the chunks under the prefix and replaces
the index with them (:meth:`~kvtier.storage.s3.index.ChunkIndex.replace` keeps the writes
and removals that landed meanwhile); with ``tenant_quotas`` it then lists the tenants'
markers (:meth:`~kvtier.storage.s3.quotas.S3Ledger.relist`). A store that does not answer
leaves the index as it was: the next listing tries again.

Skipped, never indexed: an object larger than ``max_size`` (no record of the tier's: it is
never downloaded) and a name no S3 client here can address (``on_skipped`` gets those, to
count and log; :meth:`~kvtier.storage.s3.client.S3Client.list` says how they are listed
past). Whatever a listing raises, the thread logs it (through ``on_failed``) and lists again
at the next interval: it never ends before :meth:`stop`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.errors import TierError
from kvtier.repeated_log import RepeatedLog
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.index import ChunkIndex, chunk_key_of
from kvtier.storage.s3.quotas import S3Ledger

log = logging.getLogger(__name__)


class PrefixLister:
    def __init__(
        self,
        client: S3Client,
        prefix: str,
        index: ChunkIndex,
        interval_s: float,
        on_listed: Callable[[], None],
        on_failed: Callable[[BaseException], None],
        *,
        max_size: int | None = None,
        on_skipped: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.index = index
        self.interval_s = interval_s
        self.ledger: S3Ledger | None = None  # the tier's, when tenant_quotas are on
        self._on_listed = on_listed
        self._on_failed = on_failed
        self._max_size = max_size
        self._on_skipped = on_skipped
        self._repeated = RepeatedLog(log)  # one line per 30 s while the names stay
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, wait_s: float) -> bool:
        """Start the thread; wait up to ``wait_s`` for its first listing (True: it ended)."""
        self._thread = threading.Thread(target=self._loop, name="kvtier-s3-lister", daemon=True)
        self._thread.start()
        return self._first.wait(wait_s)

    def stop(self, wait_s: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # a bug: logged, and listings go on (open() stops waiting)
                self._on_failed(exc)
            finally:
                self._first.set()
            if self.interval_s <= 0 or self._stop.wait(self.interval_s):
                return

    def refresh(self) -> bool:
        """List the prefix once and make the index what it holds (keeping the writes that
        landed since the listing began), then the markers. False when the store did not
        answer."""
        started = self.index.generation()
        try:
            unlistable: list[str] = []
            found = list(self.client.list(self.prefix, unlistable))
            limit = self._max_size
            named = ((chunk_key_of(self.prefix, name), size) for name, size in found)
            listed = {
                key: size
                for key, size in named
                if key is not None and (limit is None or size <= limit)
            }
            self.index.replace(listed, since=started)
            if self.ledger is not None:  # the tenants' markers, listed after the chunks
                self.ledger.relist()
        except TierError as exc:
            self._on_failed(exc)
            return False
        if unlistable:
            self._repeated.warning(
                "unlistable",
                "s3 listing of %s skipped %d object(s) no client can name, such as %.120s; "
                "delete them",
                self.prefix,
                len(unlistable),
                ascii(unlistable[0]),  # escaped (a newline, a control character) and bounded
            )
            if self._on_skipped is not None:
                self._on_skipped(unlistable)
        self._on_listed()
        return True
