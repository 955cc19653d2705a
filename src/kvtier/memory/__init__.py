"""Chunk-aligned memory: one page-aligned buffer cut into chunk pages, and the pool that
owns their reference counts."""

from kvtier.memory.block_pool import BlockPool, pages_for_capacity
from kvtier.memory.buffer import HostBuffer

__all__ = ["BlockPool", "HostBuffer", "pages_for_capacity"]
