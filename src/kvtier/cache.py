"""The cache surface: what a connector calls, met in process by an :class:`~kvtier.Engine`
and across the host's socket by a :class:`~kvtier.server.client.ServerClient`.

Who calls what::

    cache.lookup(tokens, request_id)          -> Hit; pins the hit prefix for the request
    cache.retrieve(tokens, request_id)        -> KV of the hit prefix
    cache.retrieve_into(tokens, rid, out)     -> end of the loaded prefix, written into ``out``
    cache.store(tokens, kv)                   -> chunks newly stored (never blocks)
    cache.end_request(request_id)             -> releases what the request holds; again: no-op

:class:`KVCache` writes each of these once: it checks the arguments (:mod:`kvtier.validation`),
then hands the checked values to its implementation's hook (``_lookup``, ``_store``, ...). So
the engine and the server client accept and refuse exactly the same calls, and the
fingerprint is built in one place, :func:`fingerprint_for`: by both, and by the server that
recomputes a client's from the fields it sent.

Each call takes ``cache_salt`` (vLLM's per-request salt): a salted request's chunk keys are its
own (see :mod:`kvtier.keys`); pass the same salt to every call of one request. Every reference
a request takes lives in its lease until ``end_request``: call it on every path that ends a
request, or use ``with cache.request(rid):``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any, Required, TypedDict, Unpack

import numpy as np
import torch

from kvtier.config import Config
from kvtier.errors import InputError, StateError
from kvtier.fingerprint import Fingerprint
from kvtier.hit import Hit
from kvtier.keys import KeyChain, RequestKeys
from kvtier.layout import KVLayout
from kvtier.lifecycle import Lifecycle, Opens
from kvtier.request_salt import RequestSalt, check_salt
from kvtier.tokens import as_token_array
from kvtier.validation import (
    Prompt,
    check_buffer_start,
    check_keys,
    check_kv,
    check_out,
    check_prompt,
    check_request_id,
    check_ttft,
)


class CacheIdentity(TypedDict, total=False):
    """Whose KV a cache holds: the model and this rank's tensor-parallel slice of it. With
    the config and the layout, what every cache surface is built from (``Engine``,
    ``ServerClient``, ``Service``, ``connect``: each takes ``**identity``), declared here
    once; the server recomputes a client's from the fields its hello sent."""

    model_name: Required[str]  # part of every key
    tp_rank: int  # 0 by default
    tp_world_size: int  # 1 by default


def fingerprint_for(
    config: Config, layout: KVLayout, **identity: Unpack[CacheIdentity]
) -> Fingerprint:
    """Everything that makes KV incompatible, from the config's keys that take part."""
    return Fingerprint(
        model_name=identity["model_name"],
        layout=layout,
        chunk_size=config.chunk_size,
        hash_algorithm=config.pre_caching_hash_algorithm,
        tp_rank=identity.get("tp_rank", 0),
        tp_world_size=identity.get("tp_world_size", 1),
        cache_salt=config.cache_salt,
    )


class KVCache(Opens):
    """A tiered KV cache for one model (one tensor-parallel rank): see the module docstring.

    Construction validates and sizes; :meth:`open` (or ``with``) starts; :meth:`close` is
    idempotent. A subclass implements the hooks below the public calls."""

    def __init__(
        self, config: Config | None, layout: KVLayout, **identity: Unpack[CacheIdentity]
    ) -> None:
        """``identity``: ``model_name`` (required), ``tp_rank`` (0), ``tp_world_size`` (1)."""
        if not isinstance(layout, KVLayout):
            raise InputError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.config = config if config is not None else Config.load()
        self.layout = layout
        self.fingerprint = fingerprint_for(self.config, layout, **identity)
        self.keychain = KeyChain(self.fingerprint)
        self.chunk_bytes = layout.chunk_bytes(self.config.chunk_size)

    # -- lifecycle (open, close, with: kvtier.lifecycle.Opens) ------------------------------
    @property
    @abstractmethod
    def state(self) -> Lifecycle: ...

    # -- the request API -------------------------------------------------------------------
    def lookup(
        self,
        tokens: object,
        request_id: str,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
        checkpoint_tokens: int = 0,
    ) -> Hit:
        """Tokens of the longest cached prefix (including ``skip_leading_tokens`` the engine
        already holds), pinned for ``request_id`` until :meth:`end_request`; ``cpu_tokens``
        of them in the CPU tier. ``checkpoint_tokens`` (a state model's: where its partial
        chunks may end, a divisor of ``chunk_size``): the chunk after the hit is probed for
        the longest cached partial chunk ending at a multiple of it
        (:mod:`kvtier.engine._checkpoints`)."""
        with self._call():
            check_request_id(request_id)
            prompt = check_prompt(tokens, skip_leading_tokens, cache_salt, checkpoint_tokens)
            return self._lookup(request_id, prompt)

    def retrieve(
        self, tokens: object, request_id: str, *, cache_salt: RequestSalt | None = None
    ) -> torch.Tensor:
        """KV of the cached prefix, shape ``[planes, layers, hit, kv_heads*head_dim]``.

        ``hit`` may be shorter than :meth:`lookup` said when an entry vanished or failed its
        checksum since; the engine recomputes from there."""
        with self._call():
            check_request_id(request_id)
            return self._retrieve(request_id, check_prompt(tokens, 0, cache_salt))

    def retrieve_into(
        self,
        tokens: object,
        request_id: str,
        out: torch.Tensor,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
        out_start: int = 0,
    ) -> int:
        """Write the cached prefix into ``out`` (``[planes, layers, >=hit - out_start,
        hidden]``, row ``i`` holding token ``out_start + i``; any device). Chunks wholly inside
        ``skip_leading_tokens`` are not written; ``out_start`` (a chunk start at or before the
        skip) lets ``out`` hold only the tokens after it. Returns the end of the loaded prefix;
        rows past it may have been written (a chunk that failed its check as it was copied
        in)."""
        with self._call():
            check_request_id(request_id)
            prompt = check_prompt(tokens, skip_leading_tokens, cache_salt)
            chunk = self.config.chunk_size
            prompt = check_buffer_start("out_start", out_start, prompt, chunk)
            check_out(out, self.layout, 0)  # the hit's length: checked once it is known
            return self._retrieve_into(request_id, prompt, out)

    def store(
        self,
        tokens: object,
        kv: torch.Tensor,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
        keys: RequestKeys | None = None,
        kv_start: int = 0,
    ) -> int:
        """Store the KV of ``tokens`` (``[planes, layers, len(tokens) - kv_start,
        kv_heads*head_dim]``, row ``i`` holding token ``kv_start + i``).

        Chunks already held are skipped; chunks wholly inside ``skip_leading_tokens`` are
        hashed but not stored, and ``kv_start`` (a chunk start at or before the skip) lets
        ``kv`` hold only the tokens after it. Returns chunks newly stored; what finds no room
        is dropped and counted (never waits). ``keys``: the tokens' keys from
        :meth:`request_keys`."""
        with self._call():
            prompt = check_prompt(tokens, skip_leading_tokens, cache_salt)
            prompt = check_buffer_start("kv_start", kv_start, prompt, self.config.chunk_size)
            if keys is not None:
                check_keys(keys, self.keychain, prompt)
            check_kv(kv, self.layout, len(prompt.tokens) - prompt.base)
            return self._store(prompt, kv, keys)

    def request_keys(
        self,
        tokens: object,
        request_id: str | None = None,
        *,
        cache_salt: RequestSalt | None = None,
    ) -> RequestKeys:
        """The chunk keys of ``tokens`` for ``request_id``, to pass to :meth:`store` and to
        name its chunks (events, PD). What the request's lookup hashed is reused where the
        cache keeps it; without a request id they are hashed."""
        with self._call():
            if request_id is not None:
                check_request_id(request_id)
            return self._request_keys(as_token_array(tokens), check_salt(cache_salt), request_id)

    def end_request(self, request_id: str) -> bool:
        """Release everything ``request_id`` holds. Returns False if it held nothing (already
        ended, or never started): calling it twice is safe and never releases twice."""
        with self._call():
            check_request_id(request_id)
            return self._end_request(request_id)

    @contextmanager
    def request(self, request_id: str) -> Iterator[str]:
        """``with cache.request(rid):`` ends the request on every way out of the block."""
        try:
            yield request_id
        finally:
            with suppress(StateError):  # closed meanwhile: close ended every request already
                self.end_request(request_id)

    @abstractmethod
    def loading(self, request_id: str) -> AbstractContextManager[bool]:
        """``with cache.loading(rid) as live:`` load ``rid``'s hit only when ``live`` (it was
        looked up and not ended: a retrieve for an ended request would open a lease nobody
        ends). An end of ``rid`` meanwhile releases its lease once the block exits."""

    def record_ttft(self, seconds: float, *, prompt_tokens: int, hit_tokens: int) -> None:
        """A connector reports a request's time to first token, its prompt length and how
        many of those tokens came from the cache (the TTFT metrics, the dashboard)."""
        check_ttft(seconds, prompt_tokens, hit_tokens)
        self._record_ttft(seconds, prompt_tokens, hit_tokens)

    # -- inspection ------------------------------------------------------------------------
    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counts, gauges and every tier's usage, as one plain dict."""

    @abstractmethod
    def check_invariants(self) -> list[str]:
        """Problems with reference counts, as sentences; empty when all is well."""

    @abstractmethod
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for in-flight lower-tier writes. True when all landed."""

    # -- what an implementation provides ---------------------------------------------------
    def _call(self) -> AbstractContextManager[None]:
        """Around each public call, before its arguments are checked (the engine counts
        calls in flight and refuses them once closed)."""
        return nullcontext()

    @abstractmethod
    def _lookup(self, request_id: str, prompt: Prompt) -> Hit: ...

    @abstractmethod
    def _retrieve(self, request_id: str, prompt: Prompt) -> torch.Tensor: ...

    @abstractmethod
    def _retrieve_into(self, request_id: str, prompt: Prompt, out: torch.Tensor) -> int: ...

    @abstractmethod
    def _store(self, prompt: Prompt, kv: torch.Tensor, keys: RequestKeys | None) -> int: ...

    @abstractmethod
    def _request_keys(
        self, tokens: np.ndarray, salt: RequestSalt | None, request_id: str | None
    ) -> RequestKeys: ...

    @abstractmethod
    def _end_request(self, request_id: str) -> bool: ...

    @abstractmethod
    def _record_ttft(self, seconds: float, prompt_tokens: int, hit_tokens: int) -> None: ...
