from typing_extensions import Buffer

STREAMING: int

def stream_copy(dst: Buffer, src: Buffer, /) -> None: ...
