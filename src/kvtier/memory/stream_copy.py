"""Large copies with streaming stores, released from the GIL: :func:`copy_bytes`.

A plain copy reads each destination line before writing it (read-for-ownership); streaming
stores skip that read, so a copy moves two bytes of memory traffic per byte instead of three.
Measured on this project's two-core hosts, 256 MiB into a shared-memory mapping: memcpy
18-24 GB/s on two threads, streaming stores 29-35. The streaming copy is a small C extension
(``_stream_copy.c``), built when kvtier is installed; where it could not be built (no C
compiler) :func:`copy_bytes` is ``numpy.copyto`` and :data:`STREAMING` is False.

The same extension copies and hashes in one pass (``copy_hash``, the PD chunk checksum of
:mod:`kvtier.pd.checksum`), also without the GIL; it is compiled where the system's
``xxhash.h`` is found (Debian: libxxhash-dev, which ``make`` installs), with xxh3 vectorised
for the CPU found at import (:data:`HASH_ISA`). Without it :data:`native_copy_hash` is None and
the checksum is computed with python ``xxhash``, to the same digests.

Streaming stores leave the destination out of the cache, the right thing for chunks of tens
of MiB that are read again much later, and the wrong one for a small piece about to be read:
pieces under :data:`STREAM_MIN_BYTES` take the plain copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_native: Callable[..., None] | None
try:
    from kvtier.memory._stream_copy import stream_copy as _native
except ImportError:  # built without a C compiler: plain copies
    _native = None

STREAMING = _native is not None

# copy_hash(dsts or None, srcs, block_bytes, stream_min) -> each block's xxh3-64 digest, 8
# little-endian bytes each (the kernel: _copy_hash.h). None where it was not built.
native_copy_hash: Callable[..., bytes] | None
HASH_ISA = ""  # what xxh3 runs on in native_copy_hash: "avx512", "avx2" or "default"
try:
    from kvtier.memory._stream_copy import HASH_ISA as HASH_ISA
    from kvtier.memory._stream_copy import copy_hash as native_copy_hash
except ImportError:  # built without xxhash.h: kvtier.pd.checksum hashes with python xxhash
    native_copy_hash = None

STREAM_MIN_BYTES = 256 << 10


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst``: two arrays of the same shape and dtype (any strides)."""
    if (
        _native is not None
        and dst.nbytes >= STREAM_MIN_BYTES
        and dst.shape == src.shape
        and dst.dtype == src.dtype
        and dst.flags.c_contiguous
        and src.flags.c_contiguous
    ):
        _native(dst, src)
    else:
        np.copyto(dst, src)
