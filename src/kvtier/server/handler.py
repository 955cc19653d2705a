"""One client connection, served from Hello to close (one thread per connection).

The order a connection must follow (anything else is a :class:`ProtocolError`)::

    Hello            first, once
    Reserve(id)      at most one store in flight: the next Reserve waits for Commit(id)
    Commit(id)       only for the store in flight
    the rest         any order, after Hello

A request the engine refuses (bad tokens, a request id that ended) is answered with
``Failed`` and the connection stays open; a protocol violation closes it. Either way, when
the connection ends, everything it held is released (:meth:`Session.release_all`).

Bounds, so one client cannot starve the others:

- the whole Hello must come within :data:`HELLO_TIMEOUT_S` of the connect (a silent
  connection, or one that trickles its Hello a byte at a time, does not keep a client slot);
  after it, every frame begun must be whole within ``STALL_TIMEOUT_S`` of its first byte,
  and every reply taken by the client within as long;
- a client of another protocol version gets ``Refused`` naming both versions;
- a connection may hold pinned at most ``server_client_pin_share`` of its model's pages, on
  every path that pins: a Lookup (or a Retrieve that looks its tokens up, having had no
  Lookup of them) pins at most the pages left of the share, so it gets a shorter hit (the
  skip alone at the share); a Reserve gets pages for at most that many chunks from its skip
  on (the store is shortened: ``Stored`` says how many went in; none at the share);
- a connection holds at most ``server_client_max_requests`` requests open and the keys of
  ``server_client_max_tokens`` tokens (:mod:`kvtier.server.sessions`): a Lookup past either
  is answered ``Failed("capacity", ...)`` naming the key; a Lookup that pinned nothing is
  ended at once, so a miss keeps neither a lease nor its keys.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.engine import Engine
from kvtier.errors import (
    CapacityError,
    InputError,
    KVTierError,
    ProtocolError,
    StateError,
    TransferError,
    TransferTimeout,
)
from kvtier.hit import Hit
from kvtier.observability.logs import describe
from kvtier.request_salt import RequestSalt
from kvtier.server import protocol as wire
from kvtier.server.models import ModelTable
from kvtier.server.sessions import Session
from kvtier.storage.writes import StoreSlot

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0


def serve_connection(
    session: Session, models: ModelTable, info: Callable[[], dict[str, Any]]
) -> None:
    """Serve ``session`` until it closes or breaks the protocol, then release what it held.
    ``info``: live server facts added to every stats reply (clients, pid, socket)."""
    sock = session.sock
    hello_by = time.monotonic() + HELLO_TIMEOUT_S
    sock.settimeout(HELLO_TIMEOUT_S)
    reader = wire.reader(sock)
    reason = "closed by the client"
    try:
        try:
            first = reader.read(hello_by)  # the whole Hello by then, however it trickles
        except (ProtocolError, TransferTimeout) as exc:
            if not reader.started:  # nothing at all within the deadline
                raise ProtocolError(f"no Hello within {HELLO_TIMEOUT_S:g} s") from None
            if time.monotonic() >= hello_by:
                raise ProtocolError(
                    f"Hello not whole within {HELLO_TIMEOUT_S:g} s of the connect"
                ) from None
            raise exc
        if first is None:
            return
        if not isinstance(first, wire.Hello):
            raise ProtocolError(f"expected Hello first, got {type(first).__name__}")
        if first.version != wire.VERSION:
            why = f"client speaks protocol version {first.version}, server {wire.VERSION}"
            wire.send(sock, wire.Refused(why), _reply_by())
            raise ProtocolError(why)
        try:
            session.slot = models.slot_for(first)
        except KVTierError as exc:
            log.warning("%s refused: %s", session, exc)
            wire.send(sock, wire.Refused(str(exc)), _reply_by())
            reason = "refused"
            return
        engine = session.slot.engine
        welcome = wire.Welcome(engine.num_pages, engine.chunk_bytes, os.getpid())
        sock.settimeout(wire.STALL_TIMEOUT_S)
        socket.send_fds(sock, [wire.encode(welcome)], [session.slot.memory.fd])
        reader.set_idle_timeout(None)  # a client may idle between requests
        log.info("%s connected: model %r", session, first.model_name)
        while True:
            message = reader.read()
            if message is None:
                break
            wire.send(sock, _answer(session, engine, message, info), _reply_by())
    except ProtocolError as exc:
        reason = f"protocol error: {exc}"
        log.error("%s: %s; closing its connection", session, exc)
    except (TransferError, OSError) as exc:
        reason = f"connection lost: {exc}"
    except Exception as exc:  # a bug serving one client must not take the server down
        reason = f"internal error: {exc!r}"
        log.exception("%s: internal error; closing its connection", session)
    finally:
        released = session.release_all()
        if session.slot is not None:
            models.release(session.slot)
        sock.close()
        log.info("%s gone (%s); released %d requests", session, reason, released)


def _answer(
    session: Session, engine: Engine, message: wire.Message, info: Callable[[], dict[str, Any]]
) -> wire.Reply:
    try:
        return _dispatch(session, engine, message, info)
    except InputError as exc:
        return wire.Failed("input", str(exc))
    except StateError as exc:
        return wire.Failed("state", str(exc))
    except CapacityError as exc:
        return wire.Failed("capacity", str(exc))
    except ProtocolError:
        raise
    except KVTierError as exc:
        return wire.Failed("tier", str(exc))


def _dispatch(
    session: Session, engine: Engine, message: wire.Message, info: Callable[[], dict[str, Any]]
) -> wire.Reply:
    match message:
        case wire.Lookup(
            request_id=rid, tokens=raw, skip=skip, cache_salt=salt, checkpoints=checkpoints
        ):
            rid = session.request_id(rid)
            hit, _ = _lookup(session, engine, rid, raw, skip, salt, checkpoints)
            return hit  # the engine's answer is the reply
        case wire.Retrieve(request_id=rid, tokens=raw, skip=skip, cache_salt=salt):
            server_rid = session.request_id(rid)
            tokens = _tokens(raw)
            if not session.same_prefix(server_rid, raw, salt):
                # Not the prefix a Lookup pinned: the engine would look these tokens up
                # with no bound, so look them up here, within the share (and the bounds).
                hit, tokens = _lookup(session, engine, server_rid, raw, skip, salt)
                if _missed(hit, skip, engine):
                    return wire.Pages(hit.tokens, [], [], [])
            end, held = engine.pages().lease_pages(
                tokens, server_rid, skip_leading_tokens=skip, cache_salt=salt
            )
            return wire.Pages(
                end, [p for p, _, _ in held], [s for _, s, _ in held], [n for _, _, n in held]
            )
        case wire.Reserve(store_id=store_id, tokens=raw, skip=skip, cache_salt=salt):
            if session.store is not None:
                raise ProtocolError(
                    f"Reserve({store_id}) while store {session.store[0]} is not committed"
                )
            tokens = _within_share(_tokens(raw), skip, session, engine)
            rid = session.store_request_id(store_id)
            slots: list[StoreSlot] = []  # at the share: none; the client commits nothing
            if len(tokens) > skip // engine.config.chunk_size * engine.config.chunk_size:
                try:
                    slots = engine.pages().reserve_pages(
                        tokens, rid, skip_leading_tokens=skip, cache_salt=salt
                    )
                except BaseException:
                    session.forget(rid)
                    engine.end_request(rid)
                    raise
            session.store = (store_id, rid, slots)
            return wire.Pages(
                0,
                [s.page for s in slots],
                [s.span.start for s in slots],
                [s.span.num_tokens for s in slots],
            )
        case wire.Commit(store_id=store_id, ok=ok):
            if session.store is None or session.store[0] != store_id:
                raise ProtocolError(f"Commit({store_id}) of a store that was never reserved")
            _, rid, slots = session.store
            session.store = None
            session.forget(rid)
            if not slots:  # nothing reserved (all held already, or over the pin budget)
                engine.end_request(rid)
                return wire.Stored(0)
            try:
                return wire.Stored(engine.pages().commit_pages(rid, slots) if ok else 0)
            finally:
                engine.end_request(rid)  # commit_pages ended it already; again is a no-op
        case wire.EndRequest(request_id=rid):
            server_rid = session.request_id(rid)
            session.forget(server_rid)
            record = engine.request_record(server_rid)
            ended = engine.end_request(server_rid)
            noted = ended and record is not None and record.noted
            return wire.Ended(ended, describe(rid, record) if noted and record else None)
        case wire.GetStats():
            server = {**info(), "admin_url": session.slot.admin_url if session.slot else None}
            return wire.StatsReply({**engine.stats(), "server": server})
        case wire.CheckInvariants():
            return wire.Problems(engine.check_invariants())
        case wire.Flush(timeout=timeout):
            if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
                raise InputError(
                    f"Flush timeout must be a finite number of seconds >= 0, got {timeout}"
                )
            return wire.Ended(engine.flush(timeout))
        case wire.RecordTTFT(seconds=seconds, prompt_tokens=prompt, hit_tokens=hit):
            engine.record_ttft(seconds, prompt_tokens=prompt, hit_tokens=hit)
            return wire.Ended(True)
        case wire.Hello():
            raise ProtocolError("a second Hello on one connection")
        case _:
            raise ProtocolError(f"{type(message).__name__} is a server message, not a request")


def _lookup(
    session: Session,
    engine: Engine,
    rid: str,
    raw: bytes,
    skip: int,
    salt: RequestSalt | None,
    checkpoints: int = 0,
) -> tuple[Hit, np.ndarray]:
    """Look ``raw`` up for ``rid`` within the connection's pin share and bounds; returns the
    hit and the tokens looked up (cut where the share ends). A lookup that pinned nothing
    and opened ``rid`` ends it at once: a miss keeps neither a lease nor its keys."""
    tokens = _within_share(_tokens(raw), skip, session, engine)
    chunk = engine.config.chunk_size
    held = min(skip // chunk, len(tokens) // chunk) * chunk
    if len(tokens) <= held:  # at the share: nothing to pin, so nothing to look up or keep
        return Hit(held, held), tokens
    opened = session.admit(rid, len(tokens))  # CapacityError past the bounds
    try:
        hit = engine.lookup(
            tokens, rid, skip_leading_tokens=skip, cache_salt=salt, checkpoint_tokens=checkpoints
        )
    except BaseException:
        if opened:
            session.forget(rid)
            engine.end_request(rid)
        raise
    if opened and _missed(hit, skip, engine):
        session.forget(rid)
        engine.end_request(rid)
    else:
        session.looked_up(rid, hit.tokens, salt, raw)
    return hit, tokens


def _missed(hit: Hit, skip: int, engine: Engine) -> bool:
    """Whether a lookup found nothing past the chunks the caller holds (pinned nothing)."""
    return hit.tokens <= skip // engine.config.chunk_size * engine.config.chunk_size


def _within_share(tokens: np.ndarray, skip: int, session: Session, engine: Engine) -> np.ndarray:
    """``tokens`` cut so that pinning (or reserving) each chunk past the skip keeps this
    connection within its pin share::

        |<-- skip chunks -->|<-- room chunks -->|  cut here ... rest of the prompt
          held by the caller   pages left of the
          (never pinned)       share (0 at it)

    Each chunk a lookup pins or a reserve gets takes one page, so at most ``room`` pages."""
    share = session.slot.pin_budget if session.slot is not None else engine.num_pages
    held = session.pinned_pages(engine)
    room = max(0, share - held)
    chunk = engine.config.chunk_size
    end = (skip // chunk + room) * chunk
    if len(tokens) <= end:
        return tokens
    log.debug("%s holds %d pinned pages of its share of %d: cut to %d tokens", session, held,
              share, end)  # fmt: skip
    return tokens[:end]


def _reply_by() -> float:
    """When the client must have taken a reply (one that never reads holds no thread)."""
    return time.monotonic() + wire.STALL_TIMEOUT_S


def _tokens(raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise ProtocolError(f"tokens field of {len(raw)} bytes is not whole int32 values")
    return np.frombuffer(raw, dtype="<i4")
