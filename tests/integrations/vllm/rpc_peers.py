"""Processes that sit at the lookup channel's other end in tests/integrations/vllm/test_rpc.py:
a worker that serves a small in-memory handler, an impostor of another uid. Started with the
spawn method (forking after torch is imported can hang); they import nothing heavy."""

from __future__ import annotations

import os
import socket
import time
from multiprocessing.queues import Queue
from typing import Any

from kvtier.integrations.vllm import rpc


class MemoryHandler:
    """A :class:`~kvtier.integrations.vllm.rpc.LookupHandler` over a dict: every prompt hits
    ``hit`` tokens (``cpu`` of them in CPU) and is remembered until ``end``."""

    def __init__(self, hit: int = 64, cpu: int = 32) -> None:
        self.hit, self.cpu = hit, cpu
        self.open: dict[str, str | None] = {}

    def lookup(self, request_id: str, tokens: list[int], cache_salt: str | None) -> rpc.Hit:
        self.open[request_id] = cache_salt
        return rpc.Hit(min(self.hit, len(tokens)), min(self.cpu, len(tokens)))

    def end(self, request_id: str) -> bool:
        return self.open.pop(request_id, "missing") != "missing"

    def stats(self) -> dict[str, Any]:
        return {"open": len(self.open), "pid": os.getpid()}

    def leaks(self) -> list[rpc.Leak]:
        return [rpc.Leak(rid, 1, []) for rid in self.open]

    def check(self) -> list[str]:
        return []

    def flush(self, timeout: float) -> bool:
        return True

    def clear(self) -> dict[str, int]:
        return {"cpu": 0}


def serve_worker(engine_id: str, directory: str, ready: Queue[Any]) -> None:
    """A lookup channel worker until killed."""
    server = rpc.LookupServer(engine_id, 0, MemoryHandler(), directory=directory).open()
    ready.put(os.getpid())
    while True:
        time.sleep(1)
    server.close()  # unreachable: killed by the test


def impostor(path: str, uid: int, ready: Queue[Any]) -> None:
    """Bind ``path`` (still root, the directory is root's), become ``uid``, then listen and
    answer like a worker with a huge hit: what a process of another user would serve."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    os.setgid(uid)
    os.setuid(uid)
    listener.listen(8)  # SO_PEERCRED reports the credentials of this call
    ready.put(os.getuid())
    while True:
        conn, _ = listener.accept()
        reader = rpc.reader(conn)
        try:
            while (message := reader.read(time.monotonic() + 30)) is not None:
                reply: rpc.Reply = rpc.Hit(1 << 20, 1 << 20)
                if isinstance(message, rpc.Hello):
                    reply = rpc.Welcome(os.getpid())
                conn.sendall(rpc.FRAMING.encode(reply))
        except Exception:
            pass
        conn.close()


def connect_as(uid: int, path: str, engine_id: str, out: Queue[Any]) -> None:
    """Become ``uid``, connect and say Hello: report what came back."""
    os.setgid(uid)
    os.setuid(uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(rpc.FRAMING.encode(rpc.Hello(rpc.VERSION, engine_id)))
        out.put(repr(rpc.reader(sock).read(time.monotonic() + 10)))
    except Exception as exc:
        out.put(f"{type(exc).__name__}: {exc}")
    finally:
        sock.close()
