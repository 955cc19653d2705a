"""``kvtier bench pd``: prefill-to-decode transfer per transport, against its physical baseline.

Two processes per transport: this one sends, a spawned decoder receives (a real Engine with
the PD tier, ending each request as soon as its transfer is done, so the buffer cycles).
Every transfer is a whole request (``--request-chunks`` chunks, 4 by default: a 1024-token
prompt): AllocRequest round trip, the chunks, each with its xxh3 checksum (computed by the
sender, verified by the receiver), RequestDone round trip.

Baselines, measured in the same run, interleaved with each transport (best of N each), all
writing a /dev/shm mapping as large as the receive buffer (the buffer's own kind of pages,
touched once at open, as it is; copying into one 32 MiB destination over and over measures the
L3 cache, not memory):

- ``memcpy_gbps``: glibc memcpy of the same bytes (``numpy.copyto``), the best of one and two
  threads, each thread copying half of a chunk;
- ``streaming_copy_gbps``: the same with streaming stores (:mod:`kvtier.memory.stream_copy`),
  the fastest way to move these bytes on this machine; the shm transport copies this way;
- ``raw_socket_gbps``: the same bytes over a plain loopback socket into a touched buffer with
  ``recv_into`` in another process, one acknowledgement per chunk.

Ratios: ``shm_ratio`` and ``nixl_ratio`` against memcpy, ``shm_ratio_streaming`` against the
streaming copy (the physical limit: what shm would do if checking the bytes were free),
``tcp_ratio`` against the raw socket. The baselines copy on Python threads, as the transport
does, not on torch's intra-op pool: its idle OpenMP workers spin on the cores for a while after
each copy, and measured half the transport's speed when it ran right after one.

What ``shm_gbps`` times: the sender's side. shm moves each byte once: the sender copies the
chunk into the decoder's page and hashes each piece of it while it is still in the cache (one
thread or two; in C without the GIL where ``copy_hash_built``, see :mod:`kvtier.pd.checksum`);
the decoder verifies every byte against that checksum only when it serves the chunk, fused
with its copy out, so that check is not in ``shm_gbps`` (it replaces a copy the decoder makes
anyway). ``shm_serve_gbps`` times it: the decoder's ``retrieve_into`` of one
checked request (lookup done; each chunk copied from the receive buffer straight into the
caller's tensor and verified in that pass, every repeat, best of ``--repeats``), and
``shm_with_serve_gbps`` is the two one after the other (``1 / (1/shm + 1/serve)``), the figure
that includes every check. ``tcp_serve_gbps`` is the same serve for tcp, whose bytes were
verified on arrival (its serve checks them again as it copies).

Their ratios: ``shm_serve_ratio`` is the serve against ``shm_serve_memcpy_gbps``, a memcpy of
as many bytes out of the receive buffer timed in the decoder process between the serves (the
decoder runs apart from the sender's baselines, so it gets its own); ``shm_with_serve_ratio`` is
the transfer and the serve against what two memcpys take (``memcpy_gbps / 2``): bytes that
go from the prefiller's KV into the decoder's memory, then from there into the decoder's KV,
are copied twice whatever checks them, so two plain copies are the physical baseline of that
path (against one memcpy the same figure is ``shm_with_serve_ratio / 2``).

Every figure is checked: after timing each transport, the sender sends one more request,
keyed by real tokens, with seeded KV; the decoder looks it up and retrieves it into a zeroed
buffer, and the bench fails (no figures) unless it found and loaded every token and every
byte equals what was sent.

Each transport is measured while only its own decoder process runs: a NIXL decoder's UCX
worker polls a core even when idle, and with it alive the other transports measured about
half their speed on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kvtier.bench.timing import best_interleaved, gbps
from kvtier.config import Config
from kvtier.config.channels import NIXL_UNAVAILABLE, nixl_installed
from kvtier.engine import Engine
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.layout import KVLayout
from kvtier.memory.stream_copy import HASH_ISA, STREAMING, copy_bytes
from kvtier.pd.channels.shm import POPULATE, SHM_DIR
from kvtier.pd.checksum import FUSED
from kvtier.pd.sender import OutChunk, PDSender, chunks_from_kv
from kvtier.service import Service

# 32 layers x 8 KV heads x 128 head dim, fp16, 256-token chunks: 32 MiB per chunk.
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
CHUNK_TOKENS = 256
MODEL = "bench-pd"
SPAWN = multiprocessing.get_context("spawn")
NIXL_REASON = (
    "UCX between two processes on one CPU host: a staging copy on the sender, then a one-sided "
    "WRITE with a notification; UCX picks its shared-memory transports on loopback"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=8, help="32 MiB chunks per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; best is reported")
    parser.add_argument("--request-chunks", type=int, default=4, help="chunks per request")
    parser.add_argument("--pages", type=int, default=8, help="receive buffer, in chunks")


def _config(channel: str, pages: int) -> Config:
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK_TOKENS)
    return Config.load(
        env={},
        overrides={
            "chunk_size": CHUNK_TOKENS,
            # A lookup reserves a CPU page per PD chunk of its hit (for a reader that maps
            # pages; retrieve_into serves straight from the buffer and leaves them unused):
            # as many as the buffer has pages, or the lookup's hit comes up short.
            "max_local_cpu_size": f"{pages * chunk_bytes}B",
            "enable_pd": True,
            "pd_role": "receiver",
            "pd_buffer_size": f"{pages * chunk_bytes}B",
            "transfer_channel": channel,
            "local_cpu": False,
        },
    )


def decoder_process(channel: str, pages: int, ports: Any, control: Connection) -> None:
    """Child: a decoder that ends every request once its transfer is done. When the sender
    has announced a check on ``control`` (before sending that request: a pipe's send is
    written by the time it returns), the decoder first serves the request as a real one
    would be: lookup, then ``retrieve_into`` a zeroed buffer, timed, ``repeats`` times; it
    answers with the tokens found and loaded, the best serve time and a digest of each
    retrieve's bytes."""
    # The Service opens the engine, then its PD receiver (pd_role receiver, 127.0.0.1, a free
    # port: no pd_peer_* keys set), and closes them in reverse.
    with Service(_config(channel, pages), LAYOUT, model_name=MODEL) as service:
        engine, receiver = service.engine, service.receiver
        assert receiver is not None  # pd_role receiver
        ports.put((engine.fingerprint.hex(), receiver.port))
        i = 0
        while (outcome := receiver.wait_outcome(f"b{i}", 600.0)) is not None:
            if control.poll():
                tokens, repeats = control.recv()
                control.send(_serve_check(engine, f"b{i}", tokens, repeats, outcome.ok))
            engine.end_request(f"b{i}")
            i += 1


def _serve_check(
    engine: Engine, rid: str, tokens: list[int], repeats: int, transfer_ok: bool
) -> ServeCheck:
    hit = engine.lookup(tokens, rid)
    out = torch.empty(LAYOUT.kv_shape(len(tokens)), dtype=LAYOUT.dtype)
    # The serve's baseline, in this process and interleaved with it: memcpy of as many bytes
    # out of the receive buffer into a touched buffer (a plain copy, nothing checked).
    buffer = engine.tier("pd").pool.buffer  # type: ignore[union-attr]
    nbytes = out.numel() * out.element_size()
    span = min(nbytes, buffer.numel())
    source, target = buffer[:span].numpy(), np.ones(span, dtype=np.uint8)
    loaded: list[int] = []
    digests: list[str] = []
    best = best_copy = float("inf")
    for _ in range(max(1, repeats)):
        out.zero_()
        start = time.perf_counter()
        loaded.append(engine.retrieve_into(tokens, rid, out))
        best = min(best, time.perf_counter() - start)
        digests.append(_digest(out))
        start = time.perf_counter()
        np.copyto(target, source)
        best_copy = min(best_copy, (time.perf_counter() - start) * nbytes / span)
    return ServeCheck(transfer_ok, hit.tokens, min(loaded), best, best_copy, tuple(digests))


@dataclass(frozen=True)
class ServeCheck:
    """The decoder's answer to a check: what it found, loaded and served."""

    transfer_ok: bool
    hit_tokens: int
    loaded_tokens: int  # the fewest any retrieve returned
    serve_s: float  # best seconds of one lookup-free retrieve_into (verify + copy out)
    memcpy_s: float  # best seconds of a memcpy of as many bytes, interleaved with the serves
    digests: tuple[str, ...]  # blake2b of each retrieve's whole buffer


def _digest(kv: torch.Tensor) -> str:
    return hashlib.blake2b(kv.contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()


def _check_source(fingerprint: str, num_chunks: int) -> tuple[list[int], list[OutChunk], str]:
    """The checked request: seeded tokens, their chunk keys as the decoder computes them, KV
    of seeded random bytes, and the digest the decoder's retrieve must match."""
    chain = KeyChain(Fingerprint(model_name=MODEL, layout=LAYOUT, chunk_size=CHUNK_TOKENS))
    if chain.fingerprint.hex() != fingerprint:
        raise AssertionError("bench pd: the decoder hashes its keys another way than the bench")
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 32000, (num_chunks * CHUNK_TOKENS,), generator=generator).tolist()
    shape = LAYOUT.kv_shape(len(tokens))
    ints = torch.randint(-(2**15), 2**15, shape, generator=generator)
    kv = (ints.to(torch.float32) / 2**13).to(LAYOUT.dtype)  # no NaN: bytes compare as values
    spans = chain.keys(tokens, include_partial=False)
    return tokens, chunks_from_kv(spans, kv), _digest(kv)


def sink_process(chunk_bytes: int, ports: Any) -> None:
    """Child: the raw-socket baseline's receiver (recv_into a touched buffer, ack per chunk)."""
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    server = socket.create_server(("127.0.0.1", 0))
    ports.put(("", server.getsockname()[1]))
    conn, _ = server.accept()
    while True:
        got = 0
        while got < chunk_bytes:
            n = conn.recv_into(view[got:], chunk_bytes - got)
            if n == 0:
                return
            got += n
        conn.sendall(b"k")


def run(args: argparse.Namespace) -> dict[str, Any]:
    chunks: int = args.chunks
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK_TOKENS)
    nbytes = chunks * chunk_bytes
    src = torch.randint(0, 255, (chunk_bytes,), dtype=torch.uint8)
    with _shm_pages(max(1, args.pages), chunk_bytes) as pages, ThreadPoolExecutor(1) as helper:
        pages[:] = src.numpy()  # touched once, like the receive buffer at open
        baselines = _copy_baselines(src.numpy(), pages, chunks, helper)
        channels = ("tcp", "shm", "nixl") if nixl_installed() else ("tcp", "shm")
        per_request = max(1, min(args.request_chunks, args.pages, chunks))
        best: dict[str, float] = {}
        for channel in channels:
            timed = _measure_channel(channel, args, src, per_request, baselines, chunk_bytes)
            for name, seconds in timed.items():
                best[name] = min(best.get(name, float("inf")), seconds)
    served = {c: gbps(per_request * chunk_bytes, best.pop(f"{c}_serve")) for c in channels}
    serve_memcpy = {
        c: gbps(per_request * chunk_bytes, best.pop(f"{c}_serve_memcpy")) for c in channels
    }
    rate = {name: gbps(nbytes, seconds) for name, seconds in best.items()}
    memcpy_gbps = max(rate["memcpy1"], rate["memcpy2"])
    streaming_gbps = max(rate["stream1"], rate["stream2"])
    nixl_gbps = rate.get("nixl")
    with_serve = 1 / (1 / rate["shm"] + 1 / served["shm"])
    return {
        "chunk_mib": chunk_bytes / 2**20,
        "chunks_per_run": chunks,
        "chunks_per_request": per_request,
        "shm_gbps": rate["shm"],
        "tcp_gbps": rate["tcp"],
        # The decoder serving one checked request (lookup done; verify and copy out):
        "shm_serve_gbps": served["shm"],
        "tcp_serve_gbps": served["tcp"],
        # shm with the decoder's check it defers to serve time, done one after the other:
        "shm_with_serve_gbps": with_serve,
        "bytes_checked": True,
        "nixl_gbps": nixl_gbps,
        "nixl_reason": NIXL_REASON if nixl_gbps is not None else NIXL_UNAVAILABLE,
        "memcpy_gbps": memcpy_gbps,
        "memcpy_1_thread_gbps": rate["memcpy1"],
        "memcpy_2_threads_gbps": rate["memcpy2"],
        "streaming_copy_gbps": streaming_gbps,
        "streaming_copy_built": STREAMING,
        # Copy and checksum fused in C without the GIL, xxh3 on this instruction set (False,
        # "": hashed with python xxhash after each streaming copy).
        "copy_hash_built": FUSED,
        "hash_isa": HASH_ISA,
        "raw_socket_gbps": rate["raw"],
        "shm_ratio": rate["shm"] / memcpy_gbps,
        "shm_serve_ratio": served["shm"] / serve_memcpy["shm"],
        "shm_serve_memcpy_gbps": serve_memcpy["shm"],
        "shm_with_serve_ratio": 2 * with_serve / memcpy_gbps,
        "shm_ratio_streaming": rate["shm"] / streaming_gbps,
        "tcp_ratio": rate["tcp"] / rate["raw"],
        "nixl_ratio": nixl_gbps / memcpy_gbps if nixl_gbps is not None else None,
    }


def _check_transfer(
    channel: str,
    sender: PDSender,
    request_id: str,
    control: Connection,
    fingerprint: str,
    num_chunks: int,
    args: argparse.Namespace,
) -> ServeCheck:
    """After timing: one more request of ``num_chunks`` chunks over the same sender, keyed by
    real tokens, which the decoder looks up and retrieves (its serve-time checks included);
    every retrieved byte must equal the source. Raises :class:`AssertionError` otherwise,
    so a transport that moves wrong bytes reports a failure, never a figure."""
    tokens, chunks, expected = _check_source(fingerprint, num_chunks)
    control.send((tokens, args.repeats))  # announced before the request can arrive
    sender.send(request_id, chunks)
    if not control.poll(300.0):
        raise AssertionError(f"bench pd {channel}: the decoder did not answer the byte check")
    served: ServeCheck = control.recv()
    problems = []
    if not served.transfer_ok:
        problems.append("the decoder recorded the transfer as failed")
    if served.hit_tokens != len(tokens) or served.loaded_tokens != len(tokens):
        problems.append(
            f"found {served.hit_tokens} and loaded {served.loaded_tokens} of {len(tokens)} tokens"
        )
    elif any(d != expected for d in served.digests):
        problems.append("the bytes served differ from the bytes sent")
    if problems:
        raise AssertionError(f"bench pd {channel}: " + "; ".join(problems))
    return served


@contextlib.contextmanager
def _shm_pages(num_pages: int, page_bytes: int) -> Iterator[np.ndarray]:
    """A /dev/shm mapping of ``num_pages`` pages, as the shm receiver makes its buffer."""
    nbytes = num_pages * page_bytes
    with tempfile.NamedTemporaryFile(dir=SHM_DIR, prefix="kvtier-bench-") as file:
        os.ftruncate(file.fileno(), nbytes)
        mapping = mmap.mmap(file.fileno(), nbytes, flags=mmap.MAP_SHARED | POPULATE)
    try:
        yield np.frombuffer(mapping, dtype=np.uint8).reshape(num_pages, page_bytes)
    finally:
        del mapping  # numpy's view keeps it mapped until the view goes


def _copy_baselines(
    src: np.ndarray, pages: np.ndarray, chunks: int, helper: ThreadPoolExecutor
) -> dict[str, Callable[[], None]]:
    """memcpy and streaming copies of ``chunks`` chunks across ``pages``, on 1 and 2 threads."""
    half = len(src) // 2

    def on(copy: Callable[[np.ndarray, np.ndarray], None], threads: int) -> Callable[[], None]:
        def run_copies() -> None:
            for i in range(chunks):
                dst = pages[i % len(pages)]
                if threads == 1:
                    copy(dst, src)
                    continue
                second = helper.submit(copy, dst[half:], src[half:])
                copy(dst[:half], src[:half])
                second.result()

        return run_copies

    return {
        "memcpy1": on(np.copyto, 1),
        "memcpy2": on(np.copyto, 2),
        "stream1": on(copy_bytes, 1),
        "stream2": on(copy_bytes, 2),
    }


def _measure_channel(
    channel: str,
    args: argparse.Namespace,
    src: torch.Tensor,
    per_request: int,
    baselines: dict[str, Callable[[], None]],
    chunk_bytes: int,
) -> dict[str, float]:
    """Best seconds for ``channel`` and its baselines, with only this channel's decoder (and,
    for tcp, the raw-socket sink) alive."""
    chunks: int = args.chunks
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        ports = SPAWN.Queue()
        control, decoder_end = SPAWN.Pipe()
        decoder = SPAWN.Process(
            target=decoder_process, args=(channel, args.pages, ports, decoder_end), daemon=True
        )
        procs.append(decoder)
        decoder.start()
        fingerprint, port = ports.get(timeout=120.0)
        sender = PDSender(
            fingerprint=fingerprint,
            layout=LAYOUT,
            chunk_size=CHUNK_TOKENS,
            host="127.0.0.1",
            port=port,
            channel=channel,
            alloc_timeout=60.0,
        ).open()
        request_ids = iter(range(1 << 40))  # the decoder counts its request ids from b0

        def transfer() -> None:
            for first in range(0, chunks, per_request):
                n = min(per_request, chunks - first)
                batch = [OutChunk(os.urandom(16), CHUNK_TOKENS, src) for _ in range(n)]
                sender.send(f"b{next(request_ids)}", batch)

        timed: dict[str, Callable[[], object]] = {**baselines, channel: transfer}
        raw: socket.socket | None = None
        if channel == "tcp":
            sink = SPAWN.Process(target=sink_process, args=(chunk_bytes, ports), daemon=True)
            procs.append(sink)
            sink.start()
            raw = socket.create_connection(("127.0.0.1", ports.get(timeout=120.0)[1]))
            connection = raw

            def raw_socket() -> None:
                for _ in range(chunks):
                    connection.sendall(src.numpy().data)
                    connection.recv(1)

            timed["raw"] = raw_socket
        try:
            best = best_interleaved(timed, args.repeats)
            served = _check_transfer(
                channel, sender, f"b{next(request_ids)}", control, fingerprint, per_request, args
            )
            best[f"{channel}_serve"] = served.serve_s
            best[f"{channel}_serve_memcpy"] = served.memcpy_s
            return best
        finally:
            sender.close()
            if raw is not None:
                raw.close()
    finally:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(10.0)
