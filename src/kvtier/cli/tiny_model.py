"""``kvtier tiny-model DIR``: a small random-weight checkpoint to point vLLM at, offline.

Every vLLM command in the docs needs ``--model``; on a machine with no network, or before
choosing a real model, there is none. This writes the checkpoint the tests and demos use
(:mod:`kvtier.demo.checkpoint`: seeded random weights, a word-level tokenizer, nothing
downloaded) and prints the vLLM command that serves it with kvtier. The weights are random,
so the text is meaningless; the KV geometry, the loads and the hits are real.

``DIR`` is overwritten only if it is empty, missing, or written by this command before (a
marker file says so): a real model that happens to be there is never replaced.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from kvtier.errors import InputError

MARKER = ".kvtier-tiny-model"

# What the printed command adds to vLLM's defaults, each for a reason: the weights are fp32
# (the CPU build has no bf16 kernels on most CPUs); eager mode skips minutes of torch.compile
# for a model this small; 4096 tokens keep vLLM's own KV space (VLLM_CPU_KVCACHE_SPACE, GiB)
# small; the connector config is the demo's, the smallest that turns kvtier on.


def add_parser(parser: argparse.ArgumentParser) -> None:
    from kvtier.demo.checkpoint import FAMILIES, SIZES

    parser.add_argument("dir", metavar="DIR", help="where to write it (created if missing)")
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default="llama",
        help="transformers/vLLM architecture of the checkpoint (default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        default="tiny",
        help="tiny: 4 layers, hidden 256 (the tests' model); small / medium: hidden 512 / "
        "1024, the shapes of `kvtier demo --model-size` (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")


def run(args: argparse.Namespace) -> int:
    from kvtier.demo.checkpoint import SIZES, write_tiny_model

    out = Path(args.dir).expanduser().resolve()
    _check_writable(out)
    shape = SIZES[args.size]
    write_tiny_model(out, args.family, shape, seed=args.seed)
    (out / MARKER).write_text(f"{args.family} {args.size} seed {args.seed}\n")
    print(
        f"wrote a {args.size} {args.family} checkpoint ({shape.num_layers} layers, hidden "
        f"{shape.hidden}, random weights, seed {args.seed}) to {out}"
    )
    print(f"serve it with kvtier: {serve_command(out)}")
    return 0


def serve_command(model: Path) -> str:
    """One line that starts vLLM on ``model`` with kvtier's connector, on both vLLM builds
    (``VLLM_CPU_KVCACHE_SPACE`` only matters to the CPU build; docs/vllm.md says why, and
    why ``--shutdown-timeout``: kvtier's queued writes land before the worker goes)."""
    from kvtier.demo.vllm_runner import CONNECTOR

    return (
        "VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server "
        f"--model {shlex.quote(str(model))} --dtype float32 --enforce-eager "
        f"--max-model-len 4096 --shutdown-timeout 30 --kv-transfer-config "
        + shlex.quote(json.dumps(CONNECTOR, separators=(",", ":")))
    )


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(f"tiny-model: {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise InputError(
            f"tiny-model: {out} holds files that `kvtier tiny-model` did not write; "
            "give a new or empty directory (nothing there is overwritten)"
        )
