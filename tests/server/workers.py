"""Client processes for the server tests, started with the spawn method (forking after
torch is imported can hang). Each reports through a queue, then does what its name says."""

from __future__ import annotations

import random
import time
from multiprocessing.queues import Queue
from typing import Any

import torch

from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens
from tests.server.server_helpers import open_client


def store_prompt(url: str, num_tokens: int, seed: int, out: Queue[Any]) -> None:
    """Store one prompt's KV and report the chunks stored."""
    with open_client(url) as client:
        out.put(client.store(make_tokens(num_tokens, seed), make_kv(num_tokens, seed)))


def fetch_prompt(url: str, num_tokens: int, seed: int, out: Queue[Any]) -> None:
    """Look up and retrieve one prompt; report (hit, KV equals what was stored)."""
    with open_client(url) as client:
        tokens = make_tokens(num_tokens, seed)
        with client.request("fetch"):
            hit = client.lookup(tokens, "fetch").tokens
            kv = client.retrieve(tokens, "fetch")
        out.put((hit, bool(torch.equal(kv, make_kv(num_tokens, seed)[:, :, :hit]))))


def hold_retrieve(url: str, num_tokens: int, seed: int, out: Queue[Any]) -> None:
    """Retrieve a stored prompt, report the hit, then keep its lease until killed."""
    client = open_client(url)
    tokens = make_tokens(num_tokens, seed)
    hit = client.lookup(tokens, "held").tokens
    client.retrieve(tokens, "held")
    out.put(hit)
    time.sleep(3600)


def hold_store(url: str, num_tokens: int, seed: int, out: Queue[Any]) -> None:
    """Start a store and stop inside it, after the server reserved pages and before the copy
    into them is done (the client's real path up to the copy); report the pages reserved."""
    client = open_client(url)

    def stall(slots: Any, kv: torch.Tensor, base: int) -> None:
        out.put(len(slots.pages))
        time.sleep(3600)

    client._pages.copy_in = stall  # type: ignore[method-assign]
    client.store(make_tokens(num_tokens, seed), make_kv(num_tokens, seed))


def churn(url: str, seed: int, out: Queue[Any]) -> None:
    """Store, look up and retrieve random prompts of a small shared family forever, reporting
    each round's number, so the parent can kill -9 at any point of any call."""
    rng = random.Random(seed)
    client = open_client(url)
    shared = make_tokens(64, 99)
    for i in range(1_000_000):
        n = rng.randrange(16, 160)
        tokens = shared + make_tokens(n, rng.randrange(4))
        kv = make_kv(len(tokens), 5)
        rid = f"churn-{i}"
        client.lookup(tokens, rid)
        out_kv = torch.empty(SMALL_LAYOUT.kv_shape(len(tokens)), dtype=SMALL_LAYOUT.dtype)
        client.retrieve_into(tokens, rid, out_kv)
        client.store(tokens, kv)
        if rng.random() < 0.8:
            client.end_request(rid)  # the rest stay open: killed with leases held
        out.put(i)


def connect_as(uid: int, path: str, out: Queue[Any]) -> None:
    """Become ``uid`` and try the server: report what happened (the reply or the error)."""
    import os
    import socket

    from kvtier.server import protocol as wire

    os.setgid(uid)
    os.setuid(uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(10)
        sock.connect(path)
        reply = wire.reader(sock).read()
        out.put(repr(reply))
    except OSError as exc:
        out.put(f"OSError: {exc}")
    finally:
        sock.close()


def impostor_server(uid: int, path: str, page_bytes: int, out: Queue[Any]) -> None:
    """Become ``uid`` and pose as the kvtier server at ``path``: a Welcome with a memfd of
    forged pages, then a 64-token hit for every lookup."""
    import os
    import socket

    from kvtier.server import protocol as wire

    os.setgid(uid)
    os.setuid(uid)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(8)
    out.put("listening")
    while True:
        conn, _ = listener.accept()
        fd = os.memfd_create("forged")
        os.ftruncate(fd, 64 * page_bytes)
        try:
            reader = wire.reader(conn)
            while (message := reader.read()) is not None:
                if isinstance(message, wire.Hello):
                    welcome = wire.encode(wire.Welcome(64, page_bytes, os.getpid()))
                    socket.send_fds(conn, [welcome], [fd])
                elif isinstance(message, wire.EndRequest):
                    wire.send(conn, wire.Ended(True))
                else:
                    wire.send(conn, wire.Hit(64))
        except Exception:
            pass
        finally:
            os.close(fd)
            conn.close()
