"""The strongest plain way to move a value through Redis: RESP over one socket, no client.

The redis benchmark's baseline. ``get_into`` sends ``GET``, reads the ``$<len>`` line with
one small ``recv`` and then ``recv_into`` a buffer allocated (and touched) beforehand, so
it pays no parsing layer, no allocation and no copy that the kernel does not make itself.
``set`` sends ``SET`` with the value's parts as they are (``sendmsg``, no join). Nothing
here checks anything beyond the RESP framing: it is the physical limit a tier is held to.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview


class RawResp:
    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._line = bytearray(64)

    def close(self) -> None:
        self.sock.close()

    def set(self, name: bytes, parts: Sequence[Buffer]) -> None:
        total = sum(memoryview(p).nbytes for p in parts)
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, total)
        for buf in (head, *parts, b"\r\n"):
            self.sock.sendall(buf)
        reply = self.sock.recv(64)
        if reply != b"+OK\r\n":
            raise RuntimeError(f"raw SET failed: {reply!r}")

    def get_into(self, name: bytes, out: memoryview) -> int:
        """``GET name`` into ``out`` (at least the value's size). Returns the value's length."""
        self.sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
        line = memoryview(self._line)
        got = self.sock.recv_into(line)
        end = self._line.find(b"\r\n", 0, got)
        while end < 0:  # the length line arrives in pieces (rare)
            got += self.sock.recv_into(line[got:])
            end = self._line.find(b"\r\n", 0, got)
        if self._line[0:1] != b"$":
            raise RuntimeError(f"raw GET failed: {bytes(self._line[:got])!r}")
        length = int(self._line[1:end])
        if length < 0:
            raise RuntimeError(f"raw GET of {name!r}: no such key")
        early = got - (end + 2)  # value bytes (and maybe the final CRLF) already read
        body = min(early, length)
        out[:body] = line[end + 2 : end + 2 + body]
        while body < length:
            body += self.sock.recv_into(out[body:length])
        tail = early - length if early > length else 0  # CRLF bytes already read
        while tail < 2:
            tail += self.sock.recv_into(line[tail:2])
        return length
