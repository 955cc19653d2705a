"""Count the kvtier source files one request's lookup, load and save pass through.

The method (issue "structure round 5": the count must not grow across a refactor): an
Engine with a CPU tier and a disk tier; a request stores a prompt, a second request looks it
up, retrieves it into a tensor and ends; a profile hook records every kvtier function called
on the calling thread (writer threads excluded: they are the tiers', not the request's).
Opening and closing the engine are not counted. Prints the count and the files::

    .venv/bin/python scripts/request-files.py
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import kvtier
from kvtier import Engine
from kvtier.config import Config
from kvtier.layout import KVLayout

PACKAGE = Path(kvtier.__file__).resolve().parent


def main() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    chunk = 16
    with tempfile.TemporaryDirectory() as disk:
        config = Config.load(
            overrides={
                "chunk_size": chunk,
                "max_local_cpu_size": f"{64 * layout.chunk_bytes(chunk)}B",
                "local_disk": disk,
                "max_local_disk_size": "0.01",
            },
            env={},
        )
        tokens = list(range(1000, 1000 + 4 * chunk))
        kv = torch.randn(layout.kv_shape(len(tokens)), dtype=layout.dtype)
        with Engine(config, layout, model_name="request-files") as engine:
            files: set[str] = set()
            caller = threading.get_ident()

            def hook(frame: FrameType, event: str, arg: Any) -> None:
                if event == "call" and threading.get_ident() == caller:
                    path = Path(frame.f_code.co_filename)
                    if path.is_relative_to(PACKAGE):
                        files.add(str(path.relative_to(PACKAGE)))

            sys.setprofile(hook)
            try:
                engine.store(tokens, kv)
                engine.lookup(tokens, "r1")
                out = torch.empty_like(kv)
                engine.retrieve_into(tokens, "r1", out)
                engine.end_request("r1")
            finally:
                sys.setprofile(None)
            assert torch.equal(out, kv)
    print(f"{len(files)} files")
    for name in sorted(files):
        print(f"  {name}")


if __name__ == "__main__":
    main()
