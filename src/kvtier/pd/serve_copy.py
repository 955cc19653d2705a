"""Serving a received PD chunk: copy it out of its page and verify every byte in one pass.

A chunk in the receive buffer was checked against its sender's checksum when it landed, or
not yet (``verify_at_serve``: shm, where the sender wrote the page itself and a publish-time
hash would be a whole extra pass over it). Either way the bytes served are hashed as they are
copied out (:class:`CopyThreads`: each piece is copied, then hashed from the cache the copy
left it in), so the bytes checked are the bytes served; the caller compares the result with
the sender's checksum and serves nothing on a mismatch. One helper thread takes half of each
chunk, started in :meth:`ServeCopier.open`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.cpu_affinity import unpin_current_thread
from kvtier.errors import InputError
from kvtier.keys import ChunkKey
from kvtier.pd.checksum import CopyThreads


class ServeCopier:
    """Copies received chunks out of their pages, returning the checksum of what it copied."""

    def __init__(self) -> None:
        self._helper: ThreadPoolExecutor | None = None  # copies and hashes half a served chunk
        self._copier: CopyThreads | None = None

    def open(self) -> None:
        if self._helper is None:
            self._helper = ThreadPoolExecutor(
                1, thread_name_prefix="kvtier-pd-serve", initializer=unpin_current_thread
            )
            self._copier = CopyThreads(self._helper)

    def close(self) -> None:
        helper, self._helper = self._helper, None
        self._copier = None
        if helper is not None:
            helper.shutdown(wait=True)

    def copy(self, key: ChunkKey, num_tokens: int, src: torch.Tensor, out: torch.Tensor) -> int:
        """Copy chunk ``key`` (``num_tokens`` tokens, its bytes ``src``) into ``out``: a flat
        uint8 view of at least the chunk's bytes, or a view of the caller's KV of exactly the
        chunk's shape. Returns the checksum of the bytes copied; on a mismatch with the
        sender's, ``out`` holds garbage and the caller serves nothing from it."""
        nbytes = src.numel()
        if out.dtype == torch.uint8 and out.dim() == 1:
            dst = out[:nbytes]
        elif out.numel() * out.element_size() == nbytes:
            dst, src = out, src.view(out.dtype).view(out.shape)
        else:
            raise InputError(
                f"PD chunk {key.hex()}: out must be uint8 bytes or a view of its "
                f"{num_tokens} tokens ({nbytes} bytes), got {out.dtype} "
                f"{tuple(out.shape)}"
            )
        assert self._copier is not None  # set at open, with the buffer's pool
        return self._copier.copy(dst, src)
