"""``kvtier bench server``: store and retrieve through a ``kvtier server`` against the same
calls on an in-process Engine, in the same run.

- ``store_ratio`` / ``retrieve_ratio``: client GB/s over in-process GB/s, the same prompts,
  the same layout: the median of ``--repeats`` alternating client/in-process pairs
  (:func:`kvtier.bench.timing.alternate`), ``*_min`` / ``*_max`` the lowest and highest pair
  (the target is >= 0.9: the data path is one copy into or out of shared memory either way;
  the server adds two or one round trips). The GB/s figures are medians of the rounds.
  ``store_cpu_ratio`` / ``retrieve_cpu_ratio``: in-process CPU seconds per call over the
  client's plus the server's, the same calls: steadier than wall time on a busy machine.
- ``lookup_rtt_us``: median round trip of a lookup of a fully cached 2,048-token prompt
  (hashing and pinning on the server included; the target is <= 200 µs), beside
  ``lookup_inproc_us``, the same lookup on an in-process Engine.
- ``retrieve_gbps_{1,2,4}_clients``: aggregate retrieve GB/s of 1, 2 and 4 client processes
  reading the same cached prompt at once (bounded by memory bandwidth and cores). Only the
  tokens each retrieve returned count: a miss (the client's answer to server trouble) moves
  nothing. Each count runs ``--rounds`` times, the counts taking turns; the figure is the
  median, and ``retrieve_{2,4}_vs_1_clients`` the median (``_min`` / ``_max``: the spread) of
  each round's ratio to the 1-client figure of the same round (the target: >= 1 at 2).
  ``load_1m`` is the host's load average when the bench ended.

The server runs as ``kvtier server`` in a child process that dies with the bench
(:mod:`kvtier.server.spawn`), its socket in a temporary directory.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

import numpy as np
import torch

from kvtier.bench.checks import require
from kvtier.bench.timing import alternate, gbps, host_load, spread
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.errors import InputError
from kvtier.layout import KVLayout
from kvtier.server.client import ServerClient, connect
from kvtier.server.spawn import spawn_server

BIG_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
LOOKUP_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
LOOKUP_TOKENS = 2048
SPAWN = multiprocessing.get_context("spawn")  # forking after torch is imported can hang


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Short calls, many repeats: on a shared machine the best of many short runs is the one
    # least disturbed, for the server and the in-process baseline alike.
    parser.add_argument("--chunks", type=int, default=4, help="chunks per store (4 = 128 MiB)")
    parser.add_argument(
        "--repeats", type=int, default=9, help="client/in-process pairs; their median is reported"
    )
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="duration of each concurrent-clients run"
    )
    parser.add_argument(
        "--clients", default="1,2,4", help="client process counts to measure together (1,2,4)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of every client count, taking turns"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    chunk_size: int = args.chunk_size
    chunks: int = args.chunks
    nbytes = chunks * BIG_LAYOUT.chunk_bytes(chunk_size)
    cpu_size = f"{2 * nbytes}B"  # half for the retrieved prompt, half for fresh stores
    config = Config.load(
        env={}, overrides={"chunk_size": chunk_size, "max_local_cpu_size": cpu_size}
    )
    directory = tempfile.mkdtemp(prefix="kvtier-bench-")
    url = f"unix://{os.path.join(directory, 'kvtier.sock')}"
    server = _start_server(url, config)
    try:
        result: dict[str, Any] = {
            "chunk_bytes": BIG_LAYOUT.chunk_bytes(chunk_size),
            "bytes": nbytes,
        }
        result.update(_transfer(url, config, chunks, args.repeats, server.pid))
        result.update(_lookup(url, config))
        result.update(_many_clients(url, config, chunks, _counts(args.clients), args))
        result["torch_threads"] = torch.get_num_threads()
        result.update(host_load())
        return result
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(directory, ignore_errors=True)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise InputError(f"--clients must be process counts such as 1,2,4, got {text!r}")
    return counts


def _start_server(url: str, config: Config) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "LMCACHE_"))}
    env["KVTIER_MAX_LOCAL_CPU_SIZE"] = f"{config.max_local_cpu_size}B"
    path = url.removeprefix("unix://")
    # A child that dies with this process: a bench killed by a timeout leaves no server.
    proc = spawn_server(path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvtier server did not start for the benchmark") from None
            time.sleep(0.05)
        finally:
            probe.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _CpuMeter:
    """CPU seconds per call of each variant: this process's, plus the server's for calls
    through it. On a shared machine wall time swings with other load; CPU time much less,
    so ``*_cpu_ratio`` says what the server costs when the wall-clock ratios are noisy."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def measure(self, name: str, fn: Callable[[], None], *, remote: bool) -> Callable[[], None]:
        def measured() -> None:
            before = time.process_time() + (_cpu_seconds(self.server_pid) if remote else 0.0)
            fn()
            after = time.process_time() + (_cpu_seconds(self.server_pid) if remote else 0.0)
            self.seconds[name] = self.seconds.get(name, 0.0) + after - before
            self.calls[name] = self.calls.get(name, 0) + 1

        return measured

    def per_call(self, name: str) -> float:
        return self.seconds[name] / self.calls[name]


def _transfer(
    url: str, config: Config, chunks: int, repeats: int, server_pid: int
) -> dict[str, Any]:
    num_tokens = chunks * config.chunk_size
    nbytes = chunks * BIG_LAYOUT.chunk_bytes(config.chunk_size)
    kv = torch.randn(BIG_LAYOUT.kv_shape(num_tokens), dtype=torch.float32).to(BIG_LAYOUT.dtype)
    rng = np.random.default_rng(0)
    counter = iter(range(1 << 30))
    engine = Engine(config, BIG_LAYOUT, model_name="bench-server")
    with engine, connect(url, BIG_LAYOUT, model_name="bench-server", config=config) as client:
        if not client.connected:
            raise RuntimeError("the benchmark client could not connect to its server")

        def store_fresh(cache: Engine | ServerClient) -> None:
            tokens = rng.integers(0, 32000, num_tokens, dtype=np.int32)
            tokens[0] = next(counter)  # new tokens: every chunk is really stored
            stored = cache.store(tokens, kv)
            require(stored == chunks, f"stored {stored} of {chunks} chunks")

        tokens = rng.integers(0, 32000, num_tokens, dtype=np.int32)
        out = torch.empty_like(kv)
        out.copy_(kv)  # touched once, as a connector's KV cache is

        def retrieve(cache: Engine | ServerClient) -> None:
            rid = f"r{next(counter)}"
            cache.lookup(tokens, rid)
            loaded = cache.retrieve_into(tokens, rid, out)
            cache.end_request(rid)
            require(loaded == num_tokens, f"loaded {loaded} of {num_tokens} tokens")

        cpu = _CpuMeter(server_pid)
        stores = alternate(
            {
                "engine": cpu.measure("store_engine", lambda: store_fresh(engine), remote=False),
                "server": cpu.measure("store_server", lambda: store_fresh(client), remote=True),
            },
            repeats,
        )
        engine.store(tokens, kv)
        client.store(tokens, kv)
        retrieves = alternate(
            {
                "engine": cpu.measure("retrieve_engine", lambda: retrieve(engine), remote=False),
                "server": cpu.measure("retrieve_server", lambda: retrieve(client), remote=True),
            },
            repeats,
        )
        out.zero_()
        retrieve(client)
        if not torch.equal(out, kv):
            raise AssertionError("bytes retrieved through the server differ from those stored")
    return {
        "store_inproc_gbps": round(stores.gbps("engine", nbytes), 3),
        "store_server_gbps": round(stores.gbps("server", nbytes), 3),
        **stores.ratio("server", "engine").fields("store_ratio"),
        "retrieve_inproc_gbps": round(retrieves.gbps("engine", nbytes), 3),
        "retrieve_server_gbps": round(retrieves.gbps("server", nbytes), 3),
        **retrieves.ratio("server", "engine").fields("retrieve_ratio"),
        "pairs": repeats,
        "store_cpu_ratio": round(cpu.per_call("store_engine") / cpu.per_call("store_server"), 3),
        "retrieve_cpu_ratio": round(
            cpu.per_call("retrieve_engine") / cpu.per_call("retrieve_server"), 3
        ),
    }


def _lookup(url: str, config: Config) -> dict[str, Any]:
    tokens = np.random.default_rng(1).integers(0, 32000, LOOKUP_TOKENS, dtype=np.int32)
    kv = torch.zeros(LOOKUP_LAYOUT.kv_shape(LOOKUP_TOKENS), dtype=LOOKUP_LAYOUT.dtype)
    small = config.with_overrides(max_local_cpu_size="16MiB")
    engine = Engine(small, LOOKUP_LAYOUT, model_name="bench-lookup")
    with engine, connect(url, LOOKUP_LAYOUT, model_name="bench-lookup", config=small) as client:
        medians = {}
        for name, cache in (("inproc", engine), ("server", client)):
            cache.store(tokens, kv)
            timings = []
            for i in range(300):
                rid = f"l{i}"
                start = time.perf_counter()
                hit = cache.lookup(tokens, rid).tokens
                timings.append(time.perf_counter() - start)
                cache.end_request(rid)
                require(hit == LOOKUP_TOKENS, f"lookup hit {hit} of {LOOKUP_TOKENS}")
            medians[name] = float(np.median(timings[50:])) * 1e6
    return {
        "lookup_rtt_us": round(medians["server"], 1),
        "lookup_inproc_us": round(medians["inproc"], 1),
    }


def _many_clients(
    url: str, config: Config, chunks: int, counts: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Each client count's aggregate GB/s in ``--rounds`` rounds, the counts taking turns
    (their order flipped every round, as :func:`kvtier.bench.timing.alternate` does), and
    each count's ratio to the first count's in the same round (median and spread)."""
    rates: dict[int, list[float]] = {n: [] for n in counts}
    for i in range(max(1, args.rounds)):
        for n in counts if i % 2 == 0 else counts[::-1]:
            rates[n].append(_concurrent(url, config, chunks, n, args.seconds))
    result: dict[str, Any] = {}
    first = counts[0]
    for n in counts:
        result[f"retrieve_gbps_{n}_clients"] = round(statistics.median(rates[n]), 3)
        if n != first:  # rates, not seconds: the pair's ratio is this count's over the first's
            pairs = spread(rates[first], rates[n])
            result.update(pairs.fields(f"retrieve_{n}_vs_{first}_clients"))
    result["rounds"] = max(1, args.rounds)
    return result


def _concurrent(url: str, config: Config, chunks: int, clients: int, seconds: float) -> float:
    """Aggregate retrieve GB/s of ``clients`` processes reading one cached prompt at once."""
    results: Queue[tuple[int, float, float]] = SPAWN.Queue()
    ready: Queue[int] = SPAWN.Queue()
    go = SPAWN.Event()
    procs = [
        SPAWN.Process(
            target=_retrieve_loop, args=(url, config, chunks, seconds, ready, go, results)
        )
        for _ in range(clients)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        reports = [results.get(timeout=120 + seconds) for _ in procs]
    finally:
        for proc in procs:
            proc.join(60)
    total = sum(nbytes for nbytes, _, _ in reports)
    span = max(end for _, _, end in reports) - min(start for _, start, _ in reports)
    return gbps(total, span)


def _retrieve_loop(
    url: str,
    config: Config,
    chunks: int,
    seconds: float,
    ready: Queue[int],
    go: Event,
    results: Queue[tuple[int, float, float]],
) -> None:
    """One client process: retrieve the benchmark prompt for ``seconds`` after ``go``."""
    num_tokens = chunks * config.chunk_size
    out = torch.zeros(BIG_LAYOUT.kv_shape(num_tokens), dtype=BIG_LAYOUT.dtype)
    with connect(url, BIG_LAYOUT, model_name="bench-server", config=config) as client:
        prompt = _stored_prompt(chunks, config.chunk_size)
        client.lookup(prompt, "warm")
        require(client.retrieve_into(prompt, "warm", out) == num_tokens, "prompt not cached")
        client.end_request("warm")
        ready.put(1)
        go.wait()
        calls = moved = 0
        token_bytes = BIG_LAYOUT.token_bytes()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            rid = f"c{os.getpid()}-{calls}"
            client.lookup(prompt, rid)
            # Only what came back counts: the client turns server trouble into misses.
            moved += client.retrieve_into(prompt, rid, out) * token_bytes
            client.end_request(rid)
            calls += 1
        results.put((moved, start, time.perf_counter()))


def _stored_prompt(chunks: int, chunk_size: int) -> np.ndarray:
    """The prompt ``_transfer`` stored last through the server (the same generator state)."""
    rng = np.random.default_rng(0)
    return rng.integers(0, 32000, chunks * chunk_size, dtype=np.int32)
