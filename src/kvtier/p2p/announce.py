"""What a P2P node announces: the chunks each attached model's CPU tier holds, streamed to every
follower that subscribes.

::

    CPU tier of fp ── membership listener ──▶ held[fp] ──▶ each subscriber's queue (in order)
                                                                 │
    a follower's Subscribe ──▶ stream(sock):  Holdings(fp, reset) snapshot of every model,
                                              Holdings("") caught up, then each change,
                                              Holdings("") heartbeat every lease / 3

A change is put on every subscriber's queue under the lock that takes the snapshot, so a
follower hears each change exactly once, after the snapshot it belongs after. A subscriber
that cannot keep up (its queue of :data:`SUBSCRIBER_QUEUE` changes full) is cut off rather
than told a partial story; it reconnects to a fresh snapshot. Every message must be taken
within ``timeout``: a follower that stops reading is cut off, never holds the thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.p2p import protocol as wire
from kvtier.storage.base import Membership, Tier

log = logging.getLogger(__name__)

SUBSCRIBER_QUEUE = 4096  # changes a slow subscriber may lag before it is cut off
_Change = tuple[str, Membership, list[ChunkKey]]


@dataclass(eq=False)
class _Subscriber:
    changes: queue.Queue[_Change | None] = field(
        default_factory=lambda: queue.Queue(SUBSCRIBER_QUEUE)
    )
    lost: bool = False  # a change did not fit: its stream must end, never go on partial


@dataclass
class AttachedModel:
    """One model a node serves (a :class:`~kvtier.p2p.serve.ServedModel`) and what it holds."""

    cpu: Tier
    layout: KVLayout
    page_bytes: int
    held: set[ChunkKey] = field(default_factory=set)


class Announcer:
    """The models a node runs and their followers: see the module docstring. ``stop`` is the
    node's: once set, every stream ends."""

    def __init__(self, *, timeout: float, lease_secs: float, stop: threading.Event) -> None:
        self.timeout = timeout
        self.lease_secs = lease_secs
        self._stop = stop
        self._models: dict[str, AttachedModel] = {}
        self._subscribers: list[_Subscriber] = []
        self._lock = threading.Lock()

    def attach(self, fingerprint: str, cpu: Tier, layout: KVLayout, page_bytes: int) -> None:
        """Announce what ``cpu`` (that engine's CPU tier of ``page_bytes`` pages, before any
        client uses it) holds from now on."""
        with self._lock:
            self._models[fingerprint] = AttachedModel(cpu, layout, page_bytes)

        def report(change: Membership, keys: Sequence[ChunkKey]) -> None:
            self._changed(fingerprint, cpu, change, list(keys))

        cpu.add_membership_listener(report)

    def detach(self, fingerprint: str) -> None:
        """The engine closes: its chunks are announced gone."""
        with self._lock:
            model = self._models.pop(fingerprint, None)
            if model is not None and model.held:
                self._broadcast((fingerprint, Membership.REMOVED, list(model.held)))

    def model(self, fingerprint: str) -> AttachedModel | None:
        with self._lock:
            return self._models.get(fingerprint)

    def close(self) -> None:
        """End every stream (the node's ``stop`` is set first)."""
        with self._lock:
            for sub in self._subscribers:
                with contextlib.suppress(queue.Full):
                    sub.changes.put_nowait(None)

    def _changed(self, fp: str, cpu: Tier, change: Membership, keys: list[ChunkKey]) -> None:
        with self._lock:
            model = self._models.get(fp)
            if model is None or model.cpu is not cpu:
                return
            if change is Membership.ADDED:
                model.held.update(keys)
            else:
                model.held.difference_update(keys)
            self._broadcast((fp, change, keys))

    def _broadcast(self, item: _Change) -> None:
        """Under the lock: every subscriber hears every change in order, or is cut off."""
        for sub in self._subscribers:
            try:
                sub.changes.put_nowait(item)
            except queue.Full:
                sub.lost = True  # its stream ends (see stream)

    def stream(self, sock: socket.socket) -> None:
        """Stream this node's holdings to a follower on ``sock``: a snapshot, then each change,
        until the node stops, the follower lags too far, or a send fails (raised)."""

        def send(message: wire.Message) -> None:
            wire.send(sock, message, time.monotonic() + self.timeout)

        sub = _Subscriber()
        changes = sub.changes
        with self._lock:
            snapshot = {fp: list(m.held) for fp, m in self._models.items()}
            self._subscribers.append(sub)
        try:
            for fp, keys in snapshot.items():
                for start in range(0, max(len(keys), 1), wire.KEYS_PER_MESSAGE):
                    batch = keys[start : start + wire.KEYS_PER_MESSAGE]
                    send(wire.Holdings(fp, batch, [], reset=start == 0))
            send(wire.Holdings("", [], [], reset=False))  # caught up
            while not self._stop.is_set():
                if sub.lost:
                    log.warning("P2P follower lagged %d changes: cut off", SUBSCRIBER_QUEUE)
                    return
                try:
                    item = changes.get(timeout=self.lease_secs / 3)
                except queue.Empty:
                    send(wire.Holdings("", [], []))  # heartbeat
                    continue
                if item is None:
                    return
                fp, change, keys = item
                for start in range(0, len(keys), wire.KEYS_PER_MESSAGE):
                    batch = keys[start : start + wire.KEYS_PER_MESSAGE]
                    added = batch if change is Membership.ADDED else []
                    removed = batch if change is Membership.REMOVED else []
                    send(wire.Holdings(fp, added, removed))
        finally:
            with self._lock:
                self._subscribers.remove(sub)
