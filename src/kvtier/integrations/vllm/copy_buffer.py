"""The buffer a worker gathers vLLM's blocks into before a save, and a load lands in before
it is scattered into them: ``[planes, layers, tokens, hidden]`` on the KV's device.

On a GPU host it is memory outside vLLM's budget, so it holds only the tokens one copy needs
(a save: its step's chunks; a load: the prompt past vLLM's own prefix; see ``kv_start`` /
``out_start`` in :mod:`kvtier.cache`). Fresh memory is slow to touch (~30 ms of page faults
for 96 MiB on a host), so it grows in whole chunks and is kept. One per thread that copies:
the model thread's and the loader thread's. Where the kernel reaches kvtier's pages
(:mod:`.one_copy`), none is made: the bytes go straight between vLLM's blocks and the pages.
"""

from __future__ import annotations

import torch

from kvtier.layout import KVLayout


class CopyBuffer:
    """See the module docstring."""

    def __init__(
        self, layout: KVLayout, chunk_size: int, device: torch.device, *, pin: bool = False
    ) -> None:
        """``pin``: host memory a device copies from asynchronously (a GPU load's staging)."""
        self.layout = layout
        self.chunk_size = chunk_size
        self.device = device
        self.pin = pin
        self._tensor: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Token rows held now (0 before the first copy)."""
        return 0 if self._tensor is None else int(self._tensor.shape[2])

    def rows(self, tokens: int) -> torch.Tensor:
        """The buffer, with at least ``tokens`` rows (grown in whole chunks, then kept)."""
        if self._tensor is None or self._tensor.shape[2] < tokens:
            capacity = -(-tokens // self.chunk_size) * self.chunk_size
            shape = self.layout.kv_shape(capacity)
            self._tensor = torch.zeros(
                shape, dtype=self.layout.dtype, device=self.device, pin_memory=self.pin
            )
        return self._tensor


class ModelThreadBuffers:
    """The model thread's buffers: its copy buffer on the KV's device (a save's gather, a
    load's window) and, where that is a device, pinned host staging a load lands in first.
    Both are empty until first used."""

    def __init__(self, layout: KVLayout, chunk_size: int, device: torch.device) -> None:
        self.scratch = CopyBuffer(layout, chunk_size, device)
        self.staging = CopyBuffer(
            layout, chunk_size, torch.device("cpu"), pin=device.type == "cuda"
        )

    def scratch_rows(self, tokens: int) -> torch.Tensor:
        return self.scratch.rows(tokens)
