"""One contiguous, page-aligned host buffer, allocated and touched once at open.

Why ``mmap``: ``torch.empty`` is only 64-byte aligned, and O_DIRECT reads need page
alignment. An anonymous mapping is page-aligned, and ``torch.frombuffer`` wraps it without a
copy. Why touch at open: first touch of fresh memory runs 5-30x slower than a copy, so paying
it once up front keeps the first stores as fast as the rest.

With CUDA present the buffer is also registered as pinned memory (``cudaHostRegister``) so
host-device copies are DMA; without CUDA ``pin_memory`` raises, so it is skipped.
"""

from __future__ import annotations

import logging
import mmap

import torch

from kvtier.errors import CapacityError

log = logging.getLogger(__name__)


class HostBuffer:
    """Owns ``nbytes`` of page-aligned host memory as a flat uint8 tensor."""

    def __init__(self, nbytes: int, mapping: mmap.mmap | None = None) -> None:
        """``mapping``: an existing mapping of at least ``nbytes`` (e.g. a shared-memory file
        for the PD shm transport) to use instead of a fresh anonymous one; closed by release."""
        if nbytes <= 0:
            raise ValueError(f"HostBuffer needs a positive size, got {nbytes}")
        try:
            self._map: mmap.mmap | None = mapping if mapping is not None else mmap.mmap(-1, nbytes)
        except (OSError, OverflowError) as exc:
            raise CapacityError(f"cannot map {nbytes} bytes of host memory: {exc}") from None
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)
        self.tensor.fill_(0)  # first touch, once, here rather than on the hot path
        self.pinned = self._pin()

    def _pin(self) -> bool:
        if not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            log.warning("could not pin %d bytes of host memory (cuda error %s)", self.nbytes, err)
            return False
        return True

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    def release(self) -> None:
        """Unpin, and give up this object's hold on the memory.

        The mapping is never closed by hand: ``torch.frombuffer`` keeps a reference to the
        mmap object but no buffer export, so ``mmap.close()`` would unmap the memory while
        tensor views of it are still alive (a thread finishing a transfer, a tier finishing
        a write) and they would write into unmapped memory, or into whatever mapping the
        address is reused for next. Dropping the reference instead unmaps it when the last
        view dies, and at once when there is none.
        """
        if self._map is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[no-untyped-call]
            self.pinned = False
        del self.tensor
        self._map = None
