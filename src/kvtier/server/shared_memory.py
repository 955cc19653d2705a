"""Page buffers in shared memory: a memfd the server makes and its clients map.

Why a memfd rather than a file in /dev/shm: it has no name, so nothing is left behind when
the server is killed (the memory goes with the last process that maps it), and only a
process the server handed the descriptor to (over the socket, ``SCM_RIGHTS``) can map it.
Both sides map with ``MAP_POPULATE``: the page tables are filled once at map time, not by
faults on the first copies.
"""

from __future__ import annotations

import mmap
import os

import torch

from kvtier.errors import CapacityError, TransferError

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SharedPages:
    """The server's side: one memfd, mapped by the engine's block pool (``page_memory``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fd = -1
        self.nbytes = 0

    def make(self, nbytes: int) -> mmap.mmap:
        """Create the memfd and map it; the Engine calls this once, at open."""
        try:
            fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        except OSError as exc:
            raise CapacityError(f"cannot create shared memory {self.name!r}: {exc}") from None
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise CapacityError(f"cannot map {nbytes} bytes of shared memory: {exc}") from None
        self.fd, self.nbytes = fd, nbytes
        return mapping

    def close(self) -> None:
        """Close the descriptor (the mapping goes with the pool's last view, and each
        client's mapping with that client)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_pages(fd: int, nbytes: int) -> torch.Tensor:
    """The client's side: map a received memfd as a flat uint8 tensor; closes ``fd``."""
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise TransferError(f"shared page buffer is {size} bytes, the server said {nbytes}")
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    except OSError as exc:
        raise TransferError(f"cannot map the server's page buffer: {exc}") from None
    finally:
        os.close(fd)
    # The tensor keeps the mmap alive; never mmap.close() it by hand (see HostBuffer.release).
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
