"""``kvtier.connect(url, layout, model_name=...)``: the cache surface
(:class:`kvtier.cache.KVCache`, as an :class:`~kvtier.Engine` has it, its arguments checked
there), served by a ``kvtier server`` on this host. What differs from an Engine is where the
cache lives:

- data never crosses the socket. A store asks the server for pages (``Reserve``), copies the
  KV straight into those pages of the shared buffer, then ``Commit``; a retrieve gets the
  pages its lease holds (``Retrieve``) and copies out of them. One copy each way
  (:mod:`kvtier.server.page_copies`): a store's copies land before its ``Commit`` (the
  server reads the pages on the host), and a retrieve's land before its ``EndRequest`` lets
  the server reuse the pages.
- the cache outlives this process, and a client that dies releases what it held: the server
  ends the connection's leases when its socket closes.
- a server that is down, dies or restarts never fails a request: lookups hit 0 tokens,
  retrieves load nothing, stores are dropped, and the client reconnects with backoff
  (:mod:`kvtier.server.link`). Bad arguments still raise :class:`InputError`, as in-process.

Thread-safe: one lock serializes this client's requests on its one connection (each is one
round trip); processes or threads that need parallel transfers open a client each. A store
holds it for its two round trips, not while its copies land: see :meth:`ServerClient._store`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self, TypeVar, Unpack

import numpy as np
import torch

from kvtier.cache import CacheIdentity, KVCache
from kvtier.config import Config
from kvtier.errors import InputError, StateError, TransferError
from kvtier.hit import Hit
from kvtier.keys import RequestKeys
from kvtier.layout import KVLayout, dtype_name
from kvtier.lifecycle import Lifecycle
from kvtier.memory.device import CopyEngine
from kvtier.observability.logs import request_log
from kvtier.request_salt import RequestSalt
from kvtier.server import protocol as wire
from kvtier.server.endpoint import is_default, socket_path
from kvtier.server.link import ServerLink
from kvtier.server.page_copies import PageCopies
from kvtier.validation import Prompt, check_out

log = logging.getLogger(__name__)

T = TypeVar("T")


class ServerClient(KVCache):
    """A kvtier cache in a ``kvtier server`` process, with an Engine's interface."""

    def __init__(
        self,
        url: str | None,
        layout: KVLayout,
        *,
        config: Config | None = None,
        max_backoff: float = 2.0,
        copies: CopyEngine | None = None,
        **identity: Unpack[CacheIdentity],
    ) -> None:
        """``identity``: ``model_name`` (required), ``tp_rank``, ``tp_world_size``
        (:class:`kvtier.cache.CacheIdentity`)."""
        # The same fingerprint and keys as the server computes (kvtier.cache.fingerprint_for).
        super().__init__(config, layout, **identity)
        fp = self.fingerprint
        self.url = url
        hello = wire.Hello(
            version=wire.VERSION,
            fingerprint=self.fingerprint.hex(),
            model_name=fp.model_name,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=dtype_name(layout.dtype),
            chunk_size=self.config.chunk_size,
            hash_algorithm=self.config.pre_caching_hash_algorithm,
            tp_rank=fp.tp_rank,
            tp_world_size=fp.tp_world_size,
            cache_salt=self.config.cache_salt,
            save_unfull_chunk=self.config.save_unfull_chunk,
            planes=layout.planes,
            groups=layout.describe_groups(),
        )
        path = socket_path(self.config, url)
        locate = (lambda: socket_path(self.config)) if is_default(self.config, url) else None
        self._link = ServerLink(
            path, hello, self.config.blocking_timeout_secs, max_backoff=max_backoff, locate=locate
        )
        self._lock = threading.Lock()
        # One store at a time on the connection: the server takes no Reserve before the
        # last one's Commit, and a store lets go of _lock while its copies land.
        self._store_lock = threading.Lock()
        # Requests this client looked up and has not ended: they hold a lease in the server.
        self._live: set[str] = set()
        # Requests whose lookup this client answered itself (a miss: no server, or the
        # connection broke) or whose lease went with a lost connection, not ended yet: their
        # retrieve is a miss too. Asking the server would make a fresh lookup there, which
        # may find more than the request's lookup said (a request loads what it was told).
        self._unanswered: set[str] = set()
        self._live_lock = threading.Lock()
        self._store_ids = itertools.count(1)
        self._state = Lifecycle.NEW
        self.unserved = 0  # calls answered locally as a miss: no server, or it broke
        self._pages = PageCopies(self._link, layout, copies)

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Self:
        """Connect now if the server is there; if not, calls are misses until it is."""
        with self._lock:
            if self._state is Lifecycle.CLOSED:
                raise StateError("this ServerClient is closed; create a new one")
            if self._state is Lifecycle.NEW:
                self._state = Lifecycle.OPEN
                self._pages.open()
                self._link.ensure()
        return self

    def close(self) -> None:
        """Disconnect (the server releases everything this client held). Idempotent."""
        with self._lock:
            self._state = Lifecycle.CLOSED
            self._pages.land_all()  # the server reuses the pages once the connection goes
            self._link.close()
            self._pages.close()

    @property
    def state(self) -> Lifecycle:
        return self._state

    @property
    def connected(self) -> bool:
        return self._link.connected

    # -- the request API (KVCache's hooks: the arguments are checked) ----------------------
    def _lookup(self, request_id: str, prompt: Prompt) -> Hit:
        """How many of the hit tokens are in the server's CPU tier; a miss (0 beyond the
        skip) when the server is unreachable."""
        array = prompt.tokens
        request = wire.Lookup(
            request_id, array.tobytes(), prompt.skip, prompt.salt, prompt.checkpoints
        )
        held = self._held(len(array), prompt.skip)

        def hit(reply: wire.Reply) -> Hit:
            found = _expect(reply, Hit)  # the server's engine's answer, as it made it
            with self._live_lock:
                self._live.add(request_id)
            return found

        found = self._exchange(request, hit, Hit(held, held))
        with self._live_lock:
            if request_id in self._live:
                self._unanswered.discard(request_id)
            else:
                self._unanswered.add(request_id)
        return found

    def _retrieve(self, request_id: str, prompt: Prompt) -> torch.Tensor:
        """Hit 0 without a server."""
        request = wire.Retrieve(request_id, prompt.tokens.tobytes(), 0, prompt.salt)

        def copy(reply: wire.Reply) -> torch.Tensor:
            pages = _expect(reply, wire.Pages)
            out = torch.empty(self.layout.kv_shape(pages.end), dtype=self.layout.dtype)
            self._pages.copy_out(request_id, pages, out, 0)
            return out

        nothing = torch.empty(self.layout.kv_shape(0), dtype=self.layout.dtype)
        if self._unanswered_lookup(request_id):
            return nothing
        return self._exchange(request, copy, nothing)

    def _retrieve_into(self, request_id: str, prompt: Prompt, out: torch.Tensor) -> int:
        """Copied from the shared pages straight into ``out``."""
        array = prompt.tokens
        request = wire.Retrieve(request_id, array.tobytes(), prompt.skip, prompt.salt)

        def copy(reply: wire.Reply) -> int:
            pages = _expect(reply, wire.Pages)
            check_out(out, self.layout, pages.end - prompt.base)
            self._pages.copy_out(request_id, pages, out, prompt.base)
            return pages.end

        miss = self._held(len(array), prompt.skip)
        if self._unanswered_lookup(request_id):
            return miss
        return self._exchange(request, copy, miss)

    def _unanswered_lookup(self, request_id: str) -> bool:
        with self._live_lock:
            return request_id in self._unanswered

    def _store(self, prompt: Prompt, kv: torch.Tensor, keys: RequestKeys | None) -> int:
        """The server gives pages for the chunks it lacks, this process copies into them, and
        commits them (0 without a server: the store is dropped).

        The connection's lock is held for the two round trips, not while the copies land (a
        device's copies: this client's lookups and retrieves on other threads go on). What
        the lock kept in order still holds: one store at a time on the connection
        (``_store_lock``); the Commit only once the copies landed; and only on the
        connection that reserved: one closed or lost meanwhile released the reservation,
        after ``land_all`` waited for these copies too, and the store is dropped."""
        store_id = next(self._store_ids)
        failed: BaseException | None = None  # the copy's error: raised after the pages go back
        with self._store_lock:
            with self._lock:
                if not self._ready():
                    return 0
                try:
                    tokens = prompt.tokens.tobytes()
                    reserve = wire.Reserve(store_id, tokens, prompt.skip, prompt.salt)
                    slots = _expect(_raise_failed(self._link.call(reserve)), wire.Pages)
                except _Unserved:
                    self.unserved += 1
                    return 0
                except TransferError as exc:
                    self._lost(exc)
                    return 0
                connection = self._link.connects
                try:
                    self._pages.copy_in(slots, kv, prompt.base)
                except BaseException as exc:
                    failed = exc
            try:
                self._pages.land_stores()
            except BaseException as exc:
                failed = failed or exc
            with self._lock:
                same = self._link.connected and self._link.connects == connection
                if self._state is Lifecycle.OPEN and same:
                    return self._commit(store_id, failed)
            # Closed or lost meanwhile: the reservation went with its connection. A copy's
            # error is raised, as it would have been; the server's (a page it named wrong)
            # is a miss, as on the connection it broke.
            if failed is not None and not isinstance(failed, TransferError):
                raise failed
            self.unserved += 1
            return 0

    def _commit(self, store_id: int, failed: BaseException | None) -> int:
        """Under the lock, the copies landed: the pages go in, or back after a failed copy,
        whose error is then raised (the server's own, a page it named wrong, breaks the
        connection: a miss)."""
        try:
            if failed is not None:
                try:
                    self._link.call(wire.Commit(store_id, ok=False))  # pages go back
                except TransferError as exc:  # the copy's error is the one to raise
                    self._lost(exc)
                raise failed
            return _expect(self._link.call(wire.Commit(store_id)), wire.Stored).chunks
        except _Unserved:
            self.unserved += 1
            return 0
        except TransferError as exc:
            self._lost(exc)
            return 0

    def _end_request(self, request_id: str) -> bool:
        """False if it held nothing (or the server is gone, which released it already)."""
        with self._live_lock:
            self._live.discard(request_id)
            self._unanswered.discard(request_id)
        self._pages.land(request_id)  # the server reuses the pages once the lease ends
        return self._exchange(wire.EndRequest(request_id), _log_request_line, False)

    def _request_keys(
        self, tokens: np.ndarray, salt: RequestSalt | None, request_id: str | None
    ) -> RequestKeys:
        """As the server computes them (hashed here: the server keeps its own with the
        lease), e.g. to name stored chunks in events."""
        return RequestKeys(self.keychain, tokens, salt, self.config.save_unfull_chunk)

    @contextmanager
    def loading(self, request_id: str) -> Iterator[bool]:
        """``with client.loading(rid) as live:`` load only when ``live``: this client looked
        ``rid`` up and has not ended it (a retrieve for an ended request would open a server
        lease nobody ends). An end waits for a retrieve in flight anyway: both take this
        client's one connection in turn."""
        with self._live_lock:
            live = request_id in self._live
        yield live

    def _record_ttft(self, seconds: float, prompt_tokens: int, hit_tokens: int) -> None:
        request = wire.RecordTTFT(seconds, prompt_tokens, hit_tokens)
        self._exchange(request, lambda r: None, None)

    # -- inspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The server engine's stats for this model, plus ``connected`` and ``unserved``."""
        local = {"connected": False, "unserved": self.unserved, "connects": self._link.connects}

        def merge(reply: wire.Reply) -> dict[str, Any]:
            return {**_expect(reply, wire.StatsReply).stats, **local, "connected": True}

        return self._exchange(wire.GetStats(), merge, local)

    def check_invariants(self) -> list[str]:
        """The server engine's reference audit for this model (empty when all is well). A
        client with no server holds nothing, so it has nothing to report."""
        return self._exchange(
            wire.CheckInvariants(), lambda r: _expect(r, wire.Problems).problems, []
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the server's in-flight lower-tier writes of this model."""
        return self._exchange(wire.Flush(timeout), lambda r: _expect(r, wire.Ended).ok, False)

    # -- helpers ---------------------------------------------------------------------------
    def _exchange(self, request: wire.Request, handle: Callable[[wire.Reply], T], miss: T) -> T:
        with self._lock:
            if not self._ready():
                return miss
            try:
                return handle(_raise_failed(self._link.call(request)))
            except _Unserved:
                self.unserved += 1
                return miss
            except TransferError as exc:
                self._lost(exc)
                return miss

    def _ready(self) -> bool:
        if self._state is not Lifecycle.OPEN:
            hint = "call open() or use `with`" if self._state is Lifecycle.NEW else "it was closed"
            raise StateError(f"ServerClient is {self._state.value}: {hint}")
        if self._link.ensure():
            return True
        self.unserved += 1
        return False

    def _lost(self, exc: Exception) -> None:
        self.unserved += 1
        self._pages.land_all()  # before the drop: the server then reuses the pages at once
        self._link.drop(str(exc))
        with self._live_lock:
            self._unanswered |= self._live  # the server released the connection's leases
            self._live.clear()

    def _held(self, num_tokens: int, skip: int) -> int:
        """What a miss reports: the whole chunks the engine already holds (the skip)."""
        size = self.config.chunk_size
        return min(skip // size, num_tokens // size) * size


def _raise_failed(reply: wire.Reply) -> wire.Reply:
    """A ``Failed`` reply: the caller's bad input raises as in-process; the rest is a miss."""
    if isinstance(reply, wire.Failed):
        if reply.kind == "input":
            raise InputError(reply.message)
        log.warning("kvtier server could not serve a request (%s): %s", reply.kind, reply.message)
        raise _Unserved(reply.message)
    return reply


class _Unserved(TransferError):
    """The server answered Failed (not the caller's fault): a miss, the connection is fine."""


R = TypeVar("R", bound=wire.Reply)


def _expect(reply: wire.Reply, kind: type[R]) -> R:
    if not isinstance(reply, kind):
        raise TransferError(f"expected {kind.__name__} from the server, got {type(reply).__name__}")
    return reply


def connect(
    url: str | None,
    layout: KVLayout,
    *,
    config: Config | None = None,
    **identity: Unpack[CacheIdentity],
) -> ServerClient:
    """An open :class:`ServerClient` for the ``kvtier server`` at ``url`` (``unix:///path``;
    None: the config's ``server_socket`` or the default path)."""
    return ServerClient(url, layout, config=config, **identity).open()


def _log_request_line(reply: wire.Reply) -> bool:
    """EndRequest's answer: whether the request held anything; its line (what the server's
    engine recorded of it) goes to this process's ``kvtier.requests`` log, as an in-process
    engine writes it, so a vLLM worker on a server keeps its per-request lines."""
    ended = _expect(reply, wire.Ended)
    if ended.line is not None:
        request_log.info("%s", ended.line)
    return ended.ok
