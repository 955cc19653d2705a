"""The physical baselines of ``kvtier bench pd``: memcpy and streaming copies into a /dev/shm
mapping like the receive buffer, on one and two threads, and the raw loopback socket's
receiving process. See :mod:`kvtier.bench.pd` for why each is measured as it is."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvtier.memory.stream_copy import copy_bytes
from kvtier.pd.channels.shm import SHM_DIR
from kvtier.pd.channels.shm_segments import POPULATE


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


@contextlib.contextmanager
def shm_pages(num_pages: int, page_bytes: int) -> Iterator[np.ndarray]:
    """A /dev/shm mapping of ``num_pages`` pages, as the shm receiver makes its buffer."""
    nbytes = num_pages * page_bytes
    with tempfile.NamedTemporaryFile(dir=SHM_DIR, prefix="kvtier-bench-") as file:
        os.ftruncate(file.fileno(), nbytes)
        mapping = mmap.mmap(file.fileno(), nbytes, flags=mmap.MAP_SHARED | POPULATE)
    try:
        yield np.frombuffer(mapping, dtype=np.uint8).reshape(num_pages, page_bytes)
    finally:
        del mapping  # numpy's view keeps it mapped until the view goes


def copy_baselines(
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
