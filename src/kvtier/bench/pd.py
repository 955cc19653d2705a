"""``kvtier bench pd``: prefill-to-decode transfer per transport, against its physical baseline.

Two processes per transport: this one sends, a spawned decoder receives (a real Engine with
the PD tier, ending each request as soon as its transfer is done, so the buffer cycles).
Every transfer is a whole request (``--request-chunks`` chunks, 4 by default: a 1024-token
prompt): AllocRequest round trip, the chunks, each with its xxh3 checksum (computed by the
sender, verified by the receiver), RequestDone round trip.

Baselines, measured in the same run, alternating with each transport in pairs
(:func:`kvtier.bench.timing.alternate`, ``--repeats`` pairs per transport), all writing a
/dev/shm mapping as large as the receive buffer (the buffer's own kind of pages, touched once
at open, as it is; copying into one 32 MiB destination over and over measures the L3 cache,
not memory):

- ``memcpy_gbps``: glibc memcpy of the same bytes (``numpy.copyto``), the faster of one and
  two threads in each round, each thread copying half of a chunk;
- ``streaming_copy_gbps``: the same with streaming stores (:mod:`kvtier.memory.stream_copy`),
  the fastest way to move these bytes on this machine; the shm transport copies this way;
- ``raw_socket_gbps``: the same bytes over a plain loopback socket into a touched buffer with
  ``recv_into`` in another process, one acknowledgement per chunk.

Ratios: ``shm_ratio`` and ``nixl_ratio`` against memcpy, ``shm_ratio_streaming`` against the
streaming copy (the physical limit: what shm would do if checking the bytes were free),
``tcp_ratio`` against the raw socket. Each ratio is the median of its transport's pairs
(transfer and baseline run back to back, so a burst of load on a shared host hits both), with
``*_min`` / ``*_max`` the lowest and highest pair; GB/s figures are medians of the rounds
(a baseline's over every transport's rounds), ``load_1m`` the host's load when it ended. The
baselines copy on Python threads, as the transport
does, not on torch's intra-op pool: its idle OpenMP workers spin on the cores for a while after
each copy, and measured half the transport's speed when it ran right after one.

What ``shm_gbps`` times: the sender's side. shm moves each byte once: the sender copies the
chunk into the decoder's page and hashes each piece of it while it is still in the cache (one
thread or two; in C without the GIL where ``copy_hash_built``, see :mod:`kvtier.pd.checksum`);
the decoder verifies every byte against that checksum only when it serves the chunk, fused
with its copy out, so that check is not in ``shm_gbps`` (it replaces a copy the decoder makes
anyway). ``shm_serve_gbps`` times it: the decoder's ``retrieve_into`` of one
checked request (lookup done; each chunk copied from the receive buffer straight into the
caller's tensor and verified in that pass, ``--repeats`` times, the median), and
``shm_with_serve_gbps`` is the two one after the other (``1 / (1/shm + 1/serve)``), the figure
that includes every check. ``tcp_serve_gbps`` is the same serve for tcp, whose bytes were
verified on arrival (its serve checks them again as it copies).

Their ratios: ``shm_serve_ratio`` is the serve against ``shm_serve_memcpy_gbps``, a memcpy of
as many bytes out of the receive buffer timed in the decoder process after each serve (the
decoder runs apart from the sender's baselines, so it gets its own): the median of those
pairs; ``shm_with_serve_ratio`` (from the medians, no spread of its own) is
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
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvtier.bench.pd_baselines import copy_baselines, shm_pages
from kvtier.bench.pd_channel import measure_channel
from kvtier.bench.pd_decoder import CHUNK_TOKENS, LAYOUT, ServeCheck
from kvtier.bench.timing import Rounds, gbps, host_load, spread
from kvtier.config.channels import NIXL_UNAVAILABLE, nixl_installed
from kvtier.memory.stream_copy import HASH_ISA, STREAMING
from kvtier.pd.checksum import FUSED

MEMCPY = ["memcpy1", "memcpy2"]  # a baseline's names: each round counts the faster
STREAM = ["stream1", "stream2"]
NIXL_REASON = (
    "UCX between two processes on one CPU host: a staging copy on the sender, then a one-sided "
    "WRITE with a notification; UCX picks its shared-memory transports on loopback"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=8, help="32 MiB chunks per timed run")
    parser.add_argument(
        "--repeats", type=int, default=9, help="transfer/baseline pairs; their median is reported"
    )
    parser.add_argument("--request-chunks", type=int, default=4, help="chunks per request")
    parser.add_argument("--pages", type=int, default=8, help="receive buffer, in chunks")


def run(args: argparse.Namespace) -> dict[str, Any]:
    chunks: int = args.chunks
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK_TOKENS)
    nbytes = chunks * chunk_bytes
    src = torch.randint(0, 255, (chunk_bytes,), dtype=torch.uint8)
    rounds: dict[str, Rounds] = {}
    served: dict[str, ServeCheck] = {}
    with shm_pages(max(1, args.pages), chunk_bytes) as pages, ThreadPoolExecutor(1) as helper:
        pages[:] = src.numpy()  # touched once, like the receive buffer at open
        baselines = copy_baselines(src.numpy(), pages, chunks, helper)
        channels = ("tcp", "shm", "nixl") if nixl_installed() else ("tcp", "shm")
        per_request = max(1, min(args.request_chunks, args.pages, chunks))
        for channel in channels:
            rounds[channel], served[channel] = measure_channel(
                channel, args, src, per_request, baselines, chunk_bytes
            )
    shm, tcp = rounds["shm"], rounds["tcp"]

    def baseline_gbps(names: list[str]) -> float:  # every channel's rounds of a baseline
        per_round = [s for channel in channels for s in rounds[channel].per_round(names)]
        return gbps(nbytes, statistics.median(per_round))

    request_bytes = per_request * chunk_bytes
    serve = gbps(request_bytes, statistics.median(served["shm"].serve_s))
    serve_memcpy = gbps(request_bytes, statistics.median(served["shm"].memcpy_s))
    memcpy_gbps = baseline_gbps(MEMCPY)
    shm_gbps = shm.gbps("shm", nbytes)
    nixl_gbps = rounds["nixl"].gbps("nixl", nbytes) if "nixl" in rounds else None
    nixl_ratio = (
        rounds["nixl"].ratio("nixl", MEMCPY).fields("nixl_ratio", None)
        if "nixl" in rounds
        else {"nixl_ratio": None, "nixl_ratio_min": None, "nixl_ratio_max": None}
    )
    with_serve = 1 / (1 / shm_gbps + 1 / serve)
    return {
        "chunk_mib": chunk_bytes / 2**20,
        "chunks_per_run": chunks,
        "chunks_per_request": per_request,
        "pairs": args.repeats,
        "shm_gbps": shm_gbps,
        "tcp_gbps": tcp.gbps("tcp", nbytes),
        # The decoder serving one checked request (lookup done; verify and copy out):
        "shm_serve_gbps": serve,
        "tcp_serve_gbps": gbps(request_bytes, statistics.median(served["tcp"].serve_s)),
        # shm with the decoder's check it defers to serve time, done one after the other:
        "shm_with_serve_gbps": with_serve,
        "bytes_checked": True,
        "nixl_gbps": nixl_gbps,
        "nixl_reason": NIXL_REASON if nixl_gbps is not None else NIXL_UNAVAILABLE,
        "memcpy_gbps": memcpy_gbps,
        "memcpy_1_thread_gbps": baseline_gbps(["memcpy1"]),
        "memcpy_2_threads_gbps": baseline_gbps(["memcpy2"]),
        "streaming_copy_gbps": baseline_gbps(STREAM),
        "streaming_copy_built": STREAMING,
        # Copy and checksum fused in C without the GIL, xxh3 on this instruction set (False,
        # "": hashed with python xxhash after each streaming copy).
        "copy_hash_built": FUSED,
        "hash_isa": HASH_ISA,
        "raw_socket_gbps": tcp.gbps("raw", nbytes),
        **shm.ratio("shm", MEMCPY).fields("shm_ratio", None),
        **spread(served["shm"].serve_s, served["shm"].memcpy_s).fields("shm_serve_ratio", None),
        "shm_serve_memcpy_gbps": serve_memcpy,
        "shm_with_serve_ratio": 2 * with_serve / memcpy_gbps,
        **shm.ratio("shm", STREAM).fields("shm_ratio_streaming", None),
        **tcp.ratio("tcp", "raw").fields("tcp_ratio", None),
        **nixl_ratio,
        **host_load(),
    }
