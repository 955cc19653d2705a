"""``kvtier bench server``: every field end to end, and its many-client figure counts only
the bytes retrieves returned."""

from __future__ import annotations

import json
import os
import queue
import shutil
import tempfile
import threading

import torch

from kvtier.bench.server import (
    BIG_LAYOUT,
    _retrieve_loop,
    _start_server,
    _stored_prompt,
)
from kvtier.config import Config
from kvtier.server.client import connect
from tests.bench.bench_checks import assert_spread
from tests.cli.test_main import run_cli


def test_bench_server_prints_every_field() -> None:
    result = run_cli(
        "bench", "server", "--json", "--chunks", "2", "--repeats", "1", "--chunk-size", "16",
        "--seconds", "0.2", "--clients", "1,2", "--rounds", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    # Client over in-process, the same prompts: the median of the pairs, with their spread.
    assert_spread(data, "store_ratio", "store_server_gbps", "store_inproc_gbps")
    assert_spread(data, "retrieve_ratio", "retrieve_server_gbps", "retrieve_inproc_gbps")
    assert data["pairs"] == 1 and data["load_1m"] >= 0
    for field in ("store_cpu_ratio", "retrieve_cpu_ratio", "lookup_rtt_us", "lookup_inproc_us"):
        assert data[field] > 0, field
    # One figure per client count asked for, no other.
    per_clients = {key for key in data if key.startswith("retrieve_gbps_")}
    assert per_clients == {"retrieve_gbps_1_clients", "retrieve_gbps_2_clients"}
    # 2 clients against 1 in the same round: the pair's ratio, with its spread.
    assert_spread(
        data, "retrieve_2_vs_1_clients", "retrieve_gbps_2_clients", "retrieve_gbps_1_clients"
    )
    assert data["rounds"] == 1
    assert data["chunk_bytes"] == 2 * 32 * 16 * 1024 * 2


def test_many_client_loop_counts_only_bytes_returned() -> None:
    """The server dies after the client warmed up: every timed retrieve is then a miss (the
    client's answer to server trouble), and the loop must report no bytes moved."""
    chunks, chunk_size = 2, 16
    config = Config.load(
        env={},
        overrides={
            "chunk_size": chunk_size,
            "max_local_cpu_size": f"{4 * BIG_LAYOUT.chunk_bytes(chunk_size)}B",
        },
    )
    directory = tempfile.mkdtemp(prefix="kvtier-bt-", dir="/tmp")  # a short socket path
    url = f"unix://{os.path.join(directory, 'kvtier.sock')}"
    server = _start_server(url, config)
    try:
        prompt = _stored_prompt(chunks, chunk_size)
        kv = torch.zeros(BIG_LAYOUT.kv_shape(len(prompt)), dtype=BIG_LAYOUT.dtype)
        with connect(url, BIG_LAYOUT, model_name="bench-server", config=config) as client:
            assert client.store(prompt, kv) == chunks
        ready: queue.Queue[int] = queue.Queue()
        results: queue.Queue[tuple[int, float, float]] = queue.Queue()
        go = threading.Event()
        loop = threading.Thread(
            target=_retrieve_loop,
            args=(url, config, chunks, 0.5, ready, go, results),  # type: ignore[arg-type]
        )
        loop.start()
        assert ready.get(timeout=60) == 1  # its warm-up retrieve got every token
        server.kill()
        server.wait(30)
        go.set()
        moved, start, end = results.get(timeout=120)
        loop.join(30)
        assert end > start and moved == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        shutil.rmtree(directory, ignore_errors=True)
