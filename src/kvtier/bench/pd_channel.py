"""One transport timed by ``kvtier bench pd``: its decoder process (and, for tcp, the raw
socket's sink) started, the transfer interleaved with the baselines, then the byte check, and
every process it started ended, so each transport runs with only its own decoder alive. See
:mod:`kvtier.bench.pd`."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from kvtier.bench.pd_baselines import sink_process
from kvtier.bench.pd_check import check_transfer
from kvtier.bench.pd_decoder import CHUNK_TOKENS, LAYOUT, ServeCheck, decoder_process
from kvtier.bench.timing import Rounds, alternate
from kvtier.pd.sender import OutChunk, PDSender

SPAWN = multiprocessing.get_context("spawn")
STOP_GRACE_S = 30.0


def measure_channel(
    channel: str,
    args: argparse.Namespace,
    src: torch.Tensor,
    per_request: int,
    baselines: dict[str, Callable[[], None]],
    chunk_bytes: int,
) -> tuple[Rounds, ServeCheck]:
    """``channel`` and its baselines timed in alternating rounds, and the decoder's answer to
    the byte check (its serve timed in pairs with a memcpy), with only this channel's decoder
    (and, for tcp, the raw-socket sink) alive."""
    chunks: int = args.chunks
    procs: list[BaseProcess] = []
    stop = SPAWN.Event()  # the decoder closes (and removes its shm segment) once it is set
    try:
        ports = SPAWN.Queue()
        control, fingerprint, sender = _start_decoder(channel, args.pages, ports, procs, stop)
        request_ids = iter(range(1 << 40))  # the decoder counts its request ids from b0

        def transfer() -> None:
            for first in range(0, chunks, per_request):
                n = min(per_request, chunks - first)
                batch = [OutChunk(os.urandom(16), CHUNK_TOKENS, src) for _ in range(n)]
                sender.send(f"b{next(request_ids)}", batch)

        timed: dict[str, Callable[[], object]] = {**baselines, channel: transfer}
        raw: socket.socket | None = None
        if channel == "tcp":
            raw = connection = _start_sink(chunk_bytes, ports, procs)

            def raw_socket() -> None:
                for _ in range(chunks):
                    connection.sendall(src.numpy().data)
                    connection.recv(1)

            timed["raw"] = raw_socket
        try:
            rounds = alternate(timed, args.repeats)
            served = check_transfer(
                channel, sender, f"b{next(request_ids)}", control, fingerprint, per_request, args
            )
            return rounds, served
        finally:
            sender.close()
            if raw is not None:
                raw.close()
    finally:
        stop.set()
        _end(procs)


def _start_decoder(
    channel: str, pages: int, ports: Any, procs: list[BaseProcess], stop: Any
) -> tuple[Connection, str, PDSender]:
    """Start the decoder process (into ``procs`` before it starts, so it is killed whatever
    fails next) and open a sender to it: (the control pipe, its fingerprint, the sender)."""
    control, decoder_end = SPAWN.Pipe()
    decoder = SPAWN.Process(
        target=decoder_process, args=(channel, pages, ports, decoder_end, stop), daemon=True
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
    return control, fingerprint, sender


def _start_sink(chunk_bytes: int, ports: Any, procs: list[BaseProcess]) -> socket.socket:
    """Start the raw-socket baseline's receiving process and connect to it."""
    sink = SPAWN.Process(target=sink_process, args=(chunk_bytes, ports), daemon=True)
    procs.append(sink)
    sink.start()
    return socket.create_connection(("127.0.0.1", ports.get(timeout=120.0)[1]))


def _end(procs: list[BaseProcess]) -> None:
    """Let each process end by itself (the decoder closes its receiver, which removes its
    receive segment from /dev/shm), and kill only one that does not within its grace."""
    for proc in procs:
        proc.join(STOP_GRACE_S)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)
