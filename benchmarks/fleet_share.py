"""``python -m benchmarks fleet-share``: what sharing the cache across hosts buys a fleet.

N ``kvtier server``s (one per "host", each its own socket directory and ports on loopback),
each driven by one engine (a kvtier client standing in for a vLLM instance: vLLM is too heavy
for N instances on these 2 cores); a multi-user chat trace with shared system prompts, each
round moving every user to the next host, so a user's next turn lands on a host that never saw
it. Per request the engine
looks up its prompt, loads the hit (checked equal to recomputing it: ``mismatches``),
"prefills" the rest (counted) and stores the prompt. Settings:

    none    each server's CPU tier alone
    redis   + one Redis every server shares (remote_url)
    s3      + one S3 bucket every server shares (SeaweedFS on loopback, started here)
    p2p     each server follows the others (p2p_listen, p2p_peers): a miss here is a pull

``prefill_tokens`` is what the fleet computed; ``ideal_tokens`` every distinct prefix once
(the trace's token trie); kvtier caches whole chunks, so its floor is ``chunk_floor_tokens``
(each prompt computed past the longest whole-chunk prefix an earlier prompt had). P2P
announcements and S3 listings travel in the background: before the next request the driver
waits (at most 5 s) until every other server knows the last store's chunks (its directory, or
its S3 tier's index, re-listed every second here), as a fleet's next turn, seconds later,
would find them, and every store's writes to a shared store (Redis, S3) land first
(``settle_timeouts`` counts waits that ran out).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

import kvtier
from kvtier import Config, KVLayout
from kvtier.bench.redis import _server as redis_server
from kvtier.server.daemon import KVTierServer
from kvtier.storage.registry import TIERS

SETTINGS = ("none", "redis", "s3", "p2p")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
SETTLE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=4, help="kvtier servers, one engine each")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--first-tokens", type=int, default=256)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--cpu-size", default="256MiB", help="each server's CPU tier")
    parser.add_argument("--settings", default=",".join(SETTINGS))


def trace(args: argparse.Namespace, seed: int = 7) -> list[list[int]]:
    """Round by round, user by user (as benchmarks.fleet); half the users share each of two
    system prompts."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    systems = [words(args.system_tokens) for _ in range(2)]
    history = [systems[u % 2] + words(args.first_tokens) for u in range(args.users)]
    out = []
    for _ in range(args.rounds):
        for user in range(args.users):
            out.append(list(history[user]))
            history[user] += words(args.turn_tokens)
    return out


def trie_tokens(prompts: list[list[int]], chunk: int = 1) -> int:
    """Distinct prefixes, counted in whole ``chunk``-token steps (1: every token)."""
    seen: set[tuple[int, ...]] = set()
    for prompt in prompts:
        for end in range(chunk, len(prompt) + 1, chunk):
            seen.add(tuple(prompt[:end]))
    return len(seen) * chunk


def kv_of(tokens: list[int]) -> torch.Tensor:
    """The KV a model would compute: a function of each position's token and index only
    (so of the prefix), exact in fp32."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    hidden = LAYOUT.num_kv_heads * LAYOUT.head_dim
    col = torch.arange(hidden, dtype=torch.float32)
    base = (t[:, None] * 8 + pos[:, None] / 1024)[None, None] + col[None, None, None] / 64
    layers = torch.arange(LAYOUT.num_layers, dtype=torch.float32)[None, :, None, None]
    planes = torch.tensor([0.0, 0.5])[:, None, None, None]
    return (base + layers + planes).contiguous()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def fleet(args: argparse.Namespace, extra: dict[str, object], p2p: bool) -> Iterator[list[Any]]:
    """``args.hosts`` in-process servers (threads) with ``extra`` config each."""
    ports = [free_port() for _ in range(args.hosts)]
    token = secrets.token_urlsafe(32)  # the fleet's p2p_auth_token
    servers: list[tuple[KVTierServer, threading.Thread]] = []
    dirs = [tempfile.TemporaryDirectory(prefix="kvfs-", dir="/tmp") for _ in ports]
    try:
        for port, d in zip(ports, dirs, strict=True):
            values: dict[str, object] = {"max_local_cpu_size": args.cpu_size, **extra}
            if p2p:
                values["p2p_listen"] = f"127.0.0.1:{port}"
                values["p2p_peers"] = ",".join(f"127.0.0.1:{p}" for p in ports)
                values["p2p_auth_token"] = token
            config = Config.load(overrides=values, env={})
            server = KVTierServer(config, f"{d.name}/kvtier.sock").open()
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            servers.append((server, thread))
        yield [s for s, _ in servers]
    finally:
        for server, thread in servers:
            server.stop()
            thread.join(10)
            server.close()
        for d in dirs:
            d.cleanup()


def _settle(servers: list[KVTierServer], fp: str, keys: list[bytes], tier: str | None) -> bool:
    """Wait (at most SETTLE_S) until every server in ``servers`` knows ``keys``: through its
    P2P directory (``tier`` None), or its own ``tier`` (a shared store it learns by listing)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        known = True
        for server in servers:
            if tier is None and server.p2p is not None:
                known &= None not in server.p2p.directory.holders(fp, keys)
            elif tier is not None:
                for slot in server.models.slots():
                    found = slot.engine.tier(tier)
                    known &= found is not None and all(found.contains(keys))
        if known:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002 if tier is None else 0.05)


def _one_setting(
    args: argparse.Namespace,
    prompts: list[list[int]],
    extra: dict[str, object],
    p2p: bool,
    settle_tier: str | None = None,
) -> dict[str, Any]:
    computed = hits = mismatches = settle_timeouts = 0
    started = time.monotonic()
    with fleet(args, extra, p2p) as servers, contextlib.ExitStack() as stack:
        config = Config.load(overrides={"chunk_size": args.chunk_size}, env={})
        clients = [
            stack.enter_context(
                kvtier.connect(f"unix://{s.path}", LAYOUT, model_name="fleet", config=config)
            )
            for s in servers
        ]
        for i, prompt in enumerate(prompts):
            # Each round moves every user to the next host (as a load balancer that does not
            # know the cache would), so a user's next turn is on a host that never saw it.
            host = (i % args.users + i // args.users) % len(clients)
            client = clients[host]
            rid = f"req-{i}"
            with client.request(rid):
                hit = client.lookup(prompt, rid).tokens
                if hit:
                    got = client.retrieve(prompt, rid)
                    hit = got.shape[2]  # what loaded (a pull that failed loads less)
                    mismatches += int(not torch.equal(got, kv_of(prompt[:hit])))
            hits += hit
            computed += len(prompt) - hit
            client.store(prompt, kv_of(prompt))
            # The writes to a shared store land (asynchronous: without this wait a Redis
            # fleet's next request, 0.1 s later here, missed what was still in flight).
            if not client.flush(SETTLE_S):
                settle_timeouts += 1
            if p2p or settle_tier:
                keys = [s.key for s in client.request_keys(prompt).spans]
                others = [s for k, s in enumerate(servers) if k != host]
                if not _settle(others, client.fingerprint.hex(), keys, settle_tier):
                    settle_timeouts += 1
        p2p_stats = [s.p2p.stats() for s in servers if s.p2p is not None]
    ideal = trie_tokens(prompts)
    row: dict[str, Any] = {
        "prefill_tokens": computed,
        "hit_tokens": hits,
        "ideal_tokens": ideal,
        "computed_over_ideal": round(computed / ideal, 3),
        "mismatches": mismatches,
        "wall_s": round(time.monotonic() - started, 2),
    }
    row["settle_timeouts"] = settle_timeouts
    if p2p:
        row["pulled_chunks"] = sum(s["pull_chunks"] for s in p2p_stats)
        row["pull_failures"] = sum(s["pull_failed"] + s["pull_missing"] for s in p2p_stats)
    return row


def _s3_setting(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """One SeaweedFS bucket every server shares; each server's S3 tier learns the others'
    chunks by re-listing the prefix (``s3_list_interval_secs``: 1 s here, 30 by default)."""
    if "s3" not in TIERS.schemes("remote_url"):
        return {"skipped": "no S3 tier registered (kvtier.storage.s3 not installed here)"}
    from kvtier.bench.seaweedfs import SeaweedFS

    try:
        server = SeaweedFS().start()
    except RuntimeError as exc:
        return {"skipped": f"no S3 server: {exc}"}
    try:
        server.create_bucket("fleet-share")
        creds = server.credentials_dict()
        extra: dict[str, object] = {
            "remote_url": server.url("fleet-share", "kv"),
            "extra_config": {
                "s3_endpoint_url": server.endpoint,
                "s3_region": creds.get("region", "us-east-1"),
                "aws_access_key_id": creds["access_key_id"],
                "aws_secret_access_key": creds["secret_access_key"],
                "s3_list_interval_secs": 1,
            },
        }
        return _one_setting(args, prompts, extra, p2p=False, settle_tier="s3")
    finally:
        server.cleanup()


def chunk_floor(prompts: list[list[int]], chunk: int) -> int:
    """Tokens a chunk cache must compute at best: each prompt's tokens past the longest
    whole-chunk prefix some earlier prompt already had."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for prompt in prompts:
        cached = 0
        for end in range(chunk, len(prompt) + 1, chunk):
            if tuple(prompt[:end]) in seen:
                cached = end
            else:
                break
        total += len(prompt) - cached
        for end in range(chunk, len(prompt) + 1, chunk):
            seen.add(tuple(prompt[:end]))
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = trace(args)
    settings = [s for s in args.settings.split(",") if s]
    rows: list[dict[str, Any]] = []
    floor = chunk_floor(prompts, args.chunk_size)
    for setting in settings:
        row: dict[str, Any] = {"setting": setting}
        if setting == "none":
            row |= _one_setting(args, prompts, {}, p2p=False)
        elif setting == "p2p":
            row |= _one_setting(args, prompts, {}, p2p=True)
        elif setting == "redis":
            with redis_server(None) as url:
                row |= _one_setting(args, prompts, {"remote_url": url}, p2p=False)
        elif setting == "s3":
            row |= _s3_setting(args, prompts)
        if "prefill_tokens" in row:
            row["computed_over_chunk_floor"] = round(row["prefill_tokens"] / floor, 3)
        rows.append(row)
    return {
        "hosts": args.hosts,
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "ideal_tokens": trie_tokens(prompts),
        "chunk_floor_tokens": floor,
        "rows": rows,
    }
