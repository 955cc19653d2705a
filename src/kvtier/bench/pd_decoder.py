"""The decoder side of ``kvtier bench pd``: a spawned process with a real Engine and the PD
receiver, which ends every request once its transfer is done (so the buffer cycles) and, when
the sender announces a check, serves that request as a real decoder would. The layout, chunk
size and model name are the bench's: the sender keys its chunks with the same fingerprint.
See :mod:`kvtier.bench.pd`."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.layout import KVLayout
from kvtier.service import Service

# 32 layers x 8 KV heads x 128 head dim, fp16, 256-token chunks: 32 MiB per chunk.
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
CHUNK_TOKENS = 256
MODEL = "bench-pd"
POLL_S = 0.2  # how often the decoder looks at its stop event between transfers
IDLE_S = 600.0  # no transfer for this long: the parent is gone, so the decoder ends


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


def decoder_process(
    channel: str, pages: int, ports: Any, control: Connection, stop: Any = None
) -> None:
    """Child: a decoder that ends every request once its transfer is done, until ``stop`` (a
    multiprocessing Event) is set; it then closes, removing its receive segment. When the sender
    has announced a check on ``control`` (before sending that request: a pipe's send is
    written by the time it returns), the decoder first serves the request as a real one
    would be: lookup, then ``retrieve_into`` a zeroed buffer, timed, ``repeats`` times, each
    paired with a memcpy of as many bytes; it answers with the tokens found and loaded, the
    seconds of each serve and each memcpy and a digest of each retrieve's bytes."""
    # The Service opens the engine, then its PD receiver (pd_role receiver, 127.0.0.1, a free
    # port: no pd_peer_* keys set), and closes them in reverse.
    with Service(_config(channel, pages), LAYOUT, model_name=MODEL) as service:
        engine, receiver = service.engine, service.receiver
        assert receiver is not None  # pd_role receiver
        ports.put((engine.fingerprint.hex(), receiver.port))
        i = 0
        waited = 0.0
        # Until told to stop (then the Service closes: the receive segment goes too) or idle
        # for 600 s (the parent is gone).
        while (stop is None or not stop.is_set()) and waited < IDLE_S:
            outcome = receiver.wait_outcome(f"b{i}", POLL_S)
            if outcome is None:
                waited += POLL_S
                continue
            waited = 0.0
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
    serves: list[float] = []
    copies: list[float] = []
    for _ in range(max(1, repeats)):  # pairs: a serve, then the memcpy of as many bytes
        out.zero_()
        start = time.perf_counter()
        loaded.append(engine.retrieve_into(tokens, rid, out))
        serves.append(time.perf_counter() - start)
        digests.append(digest(out))
        start = time.perf_counter()
        np.copyto(target, source)
        copies.append((time.perf_counter() - start) * nbytes / span)
    return ServeCheck(
        transfer_ok, hit.tokens, min(loaded), tuple(serves), tuple(copies), tuple(digests)
    )


@dataclass(frozen=True)
class ServeCheck:
    """The decoder's answer to a check: what it found, loaded and served."""

    transfer_ok: bool
    hit_tokens: int
    loaded_tokens: int  # the fewest any retrieve returned
    serve_s: tuple[float, ...]  # seconds of each lookup-free retrieve_into (verify + copy)
    memcpy_s: tuple[float, ...]  # seconds of a memcpy of as many bytes after each serve
    digests: tuple[str, ...]  # blake2b of each retrieve's whole buffer


def digest(kv: torch.Tensor) -> str:
    return hashlib.blake2b(kv.contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()
