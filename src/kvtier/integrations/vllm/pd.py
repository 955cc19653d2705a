"""kv_producer / kv_consumer: kvtier's PD transfer inside vLLM's worker.

The only module of the vLLM integration that imports kvtier's PD transport (``kvtier.pd``).
Two shapes, chosen by the prefiller's config:

* **one decoder** (``pd_peer_alloc_port`` set, 1P1D or xP1D): the prefiller pushes each
  chunk it saves into that decoder's receive buffer (:class:`~kvtier.pd.sender.PDSender`)::

    prefiller WorkerSide.save ── PDSender.send(transfer id) ──▶ decoder PDReceiver ──▶ buffer

* **any decoder** (no ``pd_peer_alloc_port``, xPyD): the prefiller holds each chunk in its
  send buffer (:class:`~kvtier.pd.source.PDSource`) and names its address in its answer; the
  decoder the router picked pulls from there before its lookup (:class:`DecoderPulls`)::

    prefiller WorkerSide.save ── PDSource.hold(transfer id)     (pages held, TTL running)
    answer {"kvtier_transfer_id", "remote_host", "remote_port"} ──▶ router ──▶ decoder
    decoder scheduler ── PullFrom ──▶ its worker: Puller.pull ──▶ prefiller's PD port
                                      (claim, then the chunks into its receive buffer)

Either way the chunks reach the decoder's buffer in a reservation held by the transfer id's
lease; the decoder's lookup (vLLM request id) finds and pins them; request_finished ends both.
The transfer id is the same on both sides, since vLLM's own request ids differ between the
two instances (the scheduler side, :mod:`.handoff`, draws the exchange).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from kvtier.cache import KVCache
from kvtier.cpu_affinity import unpin_current_thread
from kvtier.engine import Engine
from kvtier.errors import KVTierError
from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.pd.puller import Puller
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.sender import PDSender, chunks_from_kv
from kvtier.pd.source import PDSource
from kvtier.request_salt import RequestSalt, tenant_of
from kvtier.service import Service

log = logging.getLogger(__name__)

PULL_THREADS = 4  # pulls at once per decoder worker (each has its own connection)
RECENT_PULLS = 1000
POLL_WAIT_S = 0.05  # longest a scheduler's poll waits for a pull to end (see poll)


class PDEndpoint:
    """The prefiller worker's end of PD transfer (``pd_role: sender``): a sender to the one
    decoder its config names, or a source any decoder pulls from."""

    def __init__(self, engine: Engine, tp_rank: int) -> None:
        cfg = engine.config
        fingerprint = engine.fingerprint.hex()
        self.sender: PDSender | None = None
        self.source: PDSource | None = None
        if cfg.pd_peer_alloc_port:
            # Connects on the first send: the decoder may start after the prefiller.
            self.sender = PDSender.from_config(cfg, engine.layout, fingerprint, tp_rank=tp_rank)
        else:
            self.source = PDSource.from_config(
                cfg, engine.layout, fingerprint, tp_rank=tp_rank
            ).open()

    def send(
        self,
        transfer_id: str,
        spans: Sequence[ChunkSpan],
        kv: torch.Tensor,
        base: int = 0,
        salt: RequestSalt | None = None,
    ) -> bool:
        """Send (or hold, for a decoder to pull) ``spans`` of ``kv``
        (``[2, layers, >=end - base, hidden]``, row 0: token ``base``). False when it failed:
        the decoder then prefills those tokens itself. ``salt``: the request's, whose tenant
        the decoder charges the transfer to (a pulling decoder names its own)."""
        if not spans:
            return False
        if self.source is not None:
            return self.source.hold(transfer_id, spans, kv, base) == len(spans)
        assert self.sender is not None
        try:
            chunks = chunks_from_kv(spans, kv, base)
            self.sender.send(transfer_id, chunks, tenant=tenant_of(salt) or "")
            return True
        except KVTierError as exc:
            log.warning("kvtier PD: sending %s failed, the decoder prefills: %s", transfer_id, exc)
            return False

    def send_from_cache(
        self,
        cache: KVCache,
        transfer_id: str,
        tokens: list[int],
        salt: RequestSalt | None,
        out: torch.Tensor,
    ) -> bool:
        """Send the whole chunks of ``tokens`` that ``cache`` holds, read from it into ``out``
        (a state model's prefiller hit them: vLLM's blocks keep no state at their ends).
        False when it holds none or the send failed: the decoder prefills them itself."""
        rid = f"{transfer_id}-held"
        with cache.request(rid):
            if cache.lookup(tokens, rid, cache_salt=salt).tokens <= 0:
                return False
            end = cache.retrieve_into(tokens, rid, out, cache_salt=salt)
            spans = cache.request_keys(tokens, rid, cache_salt=salt).spans
        return self.send(transfer_id, [s for s in spans if s.end <= end], out, salt=salt)

    def stats(self) -> dict[str, Any] | None:
        """Where decoders pull from, and the send buffer's counts (None when pushing)."""
        if self.source is None:
            return None
        host, port = self.source.address
        return {"host": host, "port": port, **self.source.buffer.stats()}

    def check(self) -> list[str]:
        if self.source is None:
            return []
        return [f"pd send buffer: {p}" for p in self.source.buffer.check_invariants()]

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.source is not None:
            self.source.close()


class DecoderPulls:
    """A decoder worker's pulls (xPyD), one per transfer id, in the background: the scheduler
    starts one with its first ``poll`` and asks again until it has ended; the request's
    lookup then finds whatever arrived. Bounded in time by the receiver's deadlines."""

    def __init__(self, engine: Engine, receiver: PDReceiver) -> None:
        self.engine = engine
        self.puller = Puller(receiver)
        self._pool = ThreadPoolExecutor(
            PULL_THREADS, thread_name_prefix="kvtier-pd-pull", initializer=unpin_current_thread
        )
        self._pulls: dict[str, Future[bool]] = {}
        self._lock = threading.Lock()
        # The latest pulls, for tests and operators: (transfer id, "host:port", chunks, ok).
        self.recent: deque[tuple[str, str, int, bool]] = deque(maxlen=RECENT_PULLS)

    @classmethod
    def for_service(cls, engine: Engine, service: Service) -> DecoderPulls | None:
        """The pulls of a worker whose Service runs a PD receiver (a decoder), else None."""
        receiver = service.receiver
        return cls(engine, receiver) if isinstance(receiver, PDReceiver) else None

    def poll(
        self,
        transfer_id: str,
        tokens: list[int],
        salt: RequestSalt | None,
        host: str,
        port: int,
    ) -> bool:
        """Start pulling ``transfer_id`` (first call) or say whether it has ended (asked
        again after that, still True: the pull is forgotten when the request ends). Waits up
        to ``POLL_WAIT_S`` for it to end: vLLM asks again at once, and a scheduler spinning
        on "not yet" starves the pull's own thread of the GIL (a 600-token pull took 9.7 s
        so, under load, past the handshake deadline)."""
        with self._lock:
            pull = self._pulls.get(transfer_id)
            if pull is None:
                keys = [s.key for s in self.engine.request_keys(tokens, cache_salt=salt).spans]
                tenant = tenant_of(salt) or ""
                pull = self._pool.submit(self._pull, host, port, transfer_id, keys, tenant)
                self._pulls[transfer_id] = pull
        wait([pull], timeout=POLL_WAIT_S)
        return pull.done()

    def _pull(
        self, host: str, port: int, transfer_id: str, keys: list[ChunkKey], tenant: str
    ) -> bool:
        outcome = self.puller.pull(host, port, transfer_id, keys, tenant)
        chunks = outcome.chunks + outcome.held  # received, or in the buffer already
        self.recent.append((transfer_id, f"{host}:{port}", chunks, outcome.ok))
        if not outcome.ok:
            log.warning(
                "kvtier PD: pulling %s from %s:%d failed, the decoder prefills: %s",
                transfer_id,
                host,
                port,
                outcome.reason,
            )
        return outcome.ok

    def stats(self) -> dict[str, Any]:
        return {
            "pulls": self.puller.pulls,
            "failures": self.puller.failures,
            "recent": [list(r) for r in self.recent],
        }

    def forget(self, transfer_id: str) -> None:
        """The request ended: its pull, if still running, ends on its own (what it reserved
        arrives in an ended lease and is given back at once)."""
        with self._lock:
            self._pulls.pop(transfer_id, None)

    def close(self) -> None:
        """Before the receiver closes: that shuts a running pull's socket, and it ends."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.puller.close()
