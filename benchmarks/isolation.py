"""What the benchmarks that start vLLM share: a clean stdout for ``--json`` and a work dir.

vLLM logs to stdout, in this process and in the ones it starts, and its serving benchmark
prints its report there too; a ``--json`` run must print exactly one JSON object.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr while the block runs (children inherit it)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextmanager
def work_dir(path: str | None, prefix: str) -> Iterator[Path]:
    """``path`` (created, kept), or a temporary directory removed afterwards."""
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)
