"""Shared pieces of the PD tests: a decoder in this process, senders, a fake prefill.

``fake_prefill`` stands in for a model: KV at position p depends only on (token p, p), so a
chunk's KV depends only on its prefix, like real KV, and any process computes the same.
Sender processes are started with the spawn method (forking after torch is imported can
hang), so their entry points live here, importable by module path.
"""

from __future__ import annotations

import random
import signal
import socket
import time

import pytest
import torch

from kvtier import Engine
from kvtier.config.channels import nixl_installed
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.pd.buffer import PDBuffer
from kvtier.pd.protocol import PUSH
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.sender import PDSender, chunks_from_kv
from kvtier.trust.dial import connect
from kvtier.trust.handshake import Credentials
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, small_config

MODEL = "pd-test-model"
NIXL = pytest.param(
    "nixl", marks=pytest.mark.skipif(not nixl_installed(), reason="optional nixl not installed")
)
CHANNELS = ["tcp", "shm", NIXL]
PAGE_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


def pd_connect(
    port: int,
    token: str | None = None,
    *,
    protocol: str = PUSH,
    timeout: float | None = 5.0,
    identity: str = "a-test-sender",
) -> socket.socket:
    """A raw connection to a PD port on loopback that passed kvtier's handshake, for tests
    that speak the PD protocol frame by frame (``timeout``: the socket's, after it)."""
    me = Credentials(protocol, identity, token, "pd_auth_token")
    sock, _ = connect("127.0.0.1", port, me, time.monotonic() + 10.0, "the test's PD peer")
    sock.settimeout(timeout)
    return sock


def fake_prefill(tokens: list[int]) -> torch.Tensor:
    """A stand-in for a model's KV: each position's values depend on its token and position
    only (what prefix caching relies on), in exact integer arithmetic so that every process
    computes the same bits. A float64 sin here once differed by one float32 ULP between the
    test and a freshly spawned sender, failing the byte-for-byte comparison spuriously."""
    lay = SMALL_LAYOUT
    t = torch.tensor(tokens, dtype=torch.int64).view(1, 1, -1, 1)
    pos = torch.arange(len(tokens), dtype=torch.int64).view(1, 1, -1, 1)
    idx = torch.arange(2 * lay.num_layers * lay.hidden, dtype=torch.int64)
    mixed = t * 1_000_003 + pos * 7_919 + idx.view(2, lay.num_layers, 1, lay.hidden) * 104_729
    return ((mixed % 65_521).to(torch.float64) / 65_521.0 - 0.5).to(lay.dtype)


def decoder(
    channel: str, pages: int, timeout: float = 2.0, host: str | None = None, **overrides: object
) -> tuple[Engine, PDReceiver]:
    cfg = small_config(
        enable_pd=True,
        pd_role="receiver",
        pd_buffer_size=f"{pages * PAGE_BYTES}B",
        transfer_channel=channel,
        save_unfull_chunk=True,
        pd_allocation_timeout_sec=timeout,
        local_cpu=False,
        **overrides,
    )
    engine = Engine(cfg, SMALL_LAYOUT, model_name=MODEL).open()
    try:
        return engine, PDReceiver.for_engine(engine, host=host, port=0).open()
    except BaseException:
        engine.close()
        raise


def keychain() -> KeyChain:
    cfg = small_config(save_unfull_chunk=True)
    return KeyChain(
        Fingerprint(
            MODEL,
            SMALL_LAYOUT,
            cfg.chunk_size,
            cfg.pre_caching_hash_algorithm,
            0,
            1,
            cfg.cache_salt,
        )
    )


def sender(channel: str, port: int, timeout: float = 2.0, token: str | None = None) -> PDSender:
    return PDSender(
        fingerprint=keychain().fingerprint.hex(),
        layout=SMALL_LAYOUT,
        chunk_size=SMALL_CHUNK,
        host="127.0.0.1",
        port=port,
        channel=channel,
        alloc_timeout=timeout,
        auth_token=token,
    )


def request_tokens(i: int, seed: int = 0) -> list[int]:
    """Requests sharing one of 4 system prompts (2 chunks), then a user part; every 50th is
    oversized (12 chunks)."""
    rng = random.Random(seed * 100_003 + i)
    system = random.Random(1000 + i % 4)
    prefix = [system.randrange(32000) for _ in range(2 * SMALL_CHUNK)]
    if i % 50 == 49:
        return prefix + [rng.randrange(32000) for _ in range(10 * SMALL_CHUNK)]
    return prefix + [rng.randrange(32000) for _ in range(rng.randrange(1, 2 * SMALL_CHUNK))]


def send_one(tx: PDSender, rid: str, tokens: list[int], abort_after: int | None = None) -> None:
    spans = keychain().keys(tokens, include_partial=True)
    tx.send(rid, chunks_from_kv(spans, fake_prefill(tokens)), abort_after=abort_after)


def run_sender(channel: str, port: int, count: int, seed: int, results: object) -> None:
    """Process entry: send ``count`` requests, some aborted; report each outcome."""
    from kvtier.errors import TransferError

    rng = random.Random(seed)
    with sender(channel, port) as tx:
        for i in range(count):
            abort = 1 if rng.random() < 0.1 else None
            try:
                send_one(tx, f"r{i}", request_tokens(i, seed), abort)
                outcome = "ok"
            except TransferError as exc:
                outcome = type(exc).__name__
            results.put((f"r{i}", outcome))  # type: ignore[attr-defined]
    results.put(("done", "done"))  # type: ignore[attr-defined]


def run_stalling_sender(channel: str, port: int, ready: object) -> None:
    """Process entry: reserve a request, send part of one chunk, then hang until killed."""
    from kvtier.pd.protocol import (
        AllocReply,
        AllocRequest,
        ChunkSent,
        Hello,
        recv_message,
        send_message,
    )

    chain = keychain()
    tokens = request_tokens(1, 7)
    spans = chain.keys(tokens, include_partial=True)
    sock = pd_connect(port, timeout=None)
    send_message(
        sock, Hello(chain.fingerprint.hex(), PAGE_BYTES, SMALL_LAYOUT.token_bytes(), channel)
    )
    recv_message(sock)
    send_message(
        sock, AllocRequest("doomed", [s.key for s in spans], [s.num_tokens for s in spans])
    )
    reply = recv_message(sock)
    assert isinstance(reply, AllocReply)
    nbytes = spans[0].num_tokens * SMALL_LAYOUT.token_bytes()
    send_message(sock, ChunkSent("doomed", 0, nbytes, 0))
    if channel == "tcp":
        sock.sendall(b"\0" * (nbytes // 2))  # half a payload
    ready.set()  # type: ignore[attr-defined]
    signal.pause() if hasattr(signal, "pause") else time.sleep(3600)


def pd_tier(engine: Engine) -> PDBuffer:
    tier = engine.tier("pd")
    assert isinstance(tier, PDBuffer)
    return tier


def assert_all_free(engine: Engine) -> None:
    """After every request ended: the receive buffer is entirely free and indexes nothing,
    nothing is pinned, and every reference is accounted for."""
    tier = pd_tier(engine)
    assert tier.pool.free_pages == tier.num_pages
    assert tier.usage().entries == 0
    assert engine.leaks() == [] and engine.stats()["pinned_pages"] == 0
    assert engine.check_invariants() == [] and tier.check_invariants() == []


def run_sender_stalled_after(channel: str, port: int, full_chunks: int, ready: object) -> None:
    """Process entry: reserve request ``"doomed"`` (12 chunks), send its first
    ``full_chunks`` chunks whole through the channel's real sending code, then half of the
    next one (tcp: its header and half its payload; shm: half its page copied, no header),
    signal ``ready`` and hang until killed: the kill lands exactly there, mid-transfer."""
    from kvtier.pd.channels.shm import ShmSender
    from kvtier.pd.channels.tcp import TcpSender
    from kvtier.pd.protocol import (
        AllocReply,
        AllocRequest,
        ChunkSent,
        Hello,
        HelloReply,
        recv_message,
        send_message,
    )

    chain = keychain()
    tokens = request_tokens(49, 7)  # oversized: 12 chunks
    spans = chain.keys(tokens, include_partial=True)
    kv = fake_prefill(tokens)
    sock = pd_connect(port, timeout=None)
    send_message(
        sock, Hello(chain.fingerprint.hex(), PAGE_BYTES, SMALL_LAYOUT.token_bytes(), channel)
    )
    hello = recv_message(sock)
    assert isinstance(hello, HelloReply)
    out = ShmSender() if channel == "shm" else TcpSender()
    out.attach(hello)
    send_message(
        sock, AllocRequest("doomed", [s.key for s in spans], [s.num_tokens for s in spans])
    )
    reply = recv_message(sock)
    assert isinstance(reply, AllocReply) and not reply.held
    for i in range(full_chunks):
        data = kv[:, :, spans[i].start : spans[i].end, :]
        out.send_chunk(sock, "doomed", i, reply.pages[i], data)
    nbytes = spans[full_chunks].num_tokens * SMALL_LAYOUT.token_bytes()
    if isinstance(out, ShmSender):  # half the page copied; its ChunkSent never sent
        assert out._buffer is not None
        start = reply.pages[full_chunks] * PAGE_BYTES
        out._buffer[start : start + nbytes // 2] = 7
    else:
        send_message(sock, ChunkSent("doomed", full_chunks, nbytes, 0))
        sock.sendall(b"\0" * (nbytes // 2))  # half a payload
    ready.set()  # type: ignore[attr-defined]
    signal.pause() if hasattr(signal, "pause") else time.sleep(3600)
