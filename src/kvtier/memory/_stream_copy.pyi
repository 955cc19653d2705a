from collections.abc import Sequence

from typing_extensions import Buffer

STREAMING: int
HASH_ISA: str  # only where copy_hash was built: the kernel it uses
HASH_ISAS: tuple[str, ...]  # the kernels this CPU runs, best first

def stream_copy(dst: Buffer, src: Buffer, /) -> None: ...
def copy_hash(
    dsts: Sequence[Buffer] | None,
    srcs: Sequence[Buffer],
    block_bytes: int,
    stream_min: int,
    isa: str = ...,
    /,
) -> bytes: ...
