"""``kvtier bench NAME [--json]``: a tier measured against its physical baseline.

Each benchmark is a module ``kvtier.bench.<name>`` with ``add_arguments(parser)`` and
``run(args) -> dict`` (the JSON fields); this command prints them as a table or JSON.

These are the benchmarks an operator runs on their own hardware with nothing but kvtier
installed. Those that start vLLM, vllm-router or a transformers model live beside the package,
in the repository's ``benchmarks/`` (``python -m benchmarks NAME``), and print the same way.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

BENCHMARKS: dict[str, str] = {
    "cpu": "CPU tier store/retrieve vs memcpy, lookup cost of a 128k-token prompt",
    "disk": "disk tier write/read vs raw file I/O with fsync",
    "redis": "redis tier put/get vs raw redis-py SET/GET",
    "s3": "s3 tier put/get vs the raw S3 client on the same objects (starts SeaweedFS)",
    "pd": "prefill-to-decode transfer per transport vs memcpy and a raw socket",
    "server": "store/retrieve through a kvtier server vs in-process, lookup RTT, 1-4 clients",
    "p2p": "a P2P pull of a peer server's chunks vs a raw loopback socket, same bytes",
    "scale": "how costs grow: lookup vs prompt length, disk restart vs files, RSS, threads",
    "codec": "payload codecs: ratio, encode/decode GB/s on one thread vs memcpy, bf16 and fp32",
    "trace": "a production trace replayed through the CPU tier vs the optimum, LRU, ARC",
    "sliding": "a sliding-window model's hits per GB on a trace: every token, big chunks, "
    "lean records with whole ones at anchors",
    "paged": "vLLM's paged KV <-> pinned host pages per layout: Triton kernel, torch, pinned DMA",
}


def add_parser(
    parser: argparse.ArgumentParser,
    benchmarks: dict[str, str] = BENCHMARKS,
    package: str = "kvtier.bench",
) -> None:
    """One subcommand per benchmark module ``<package>.<name>`` that imports here (a ``-`` in
    the command's name is a ``_`` in the module's: ``pd-fleet`` runs ``pd_fleet``)."""
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, help_text in benchmarks.items():
        path = f"{package}.{name.replace('-', '_')}"
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith(path):
                raise
            continue
        bench = sub.add_parser(name, help=help_text, description=help_text)
        bench.add_argument("--json", action="store_true", help="print one JSON object")
        module.add_arguments(bench)
        # A bench with a table of its own (the one its doc shows) prints that one.
        bench.set_defaults(_bench=module.run, _text=getattr(module, "format_text", None))


def run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = args._bench(args)
    if args.json:
        print(json.dumps(result, sort_keys=False))
    else:
        print((getattr(args, "_text", None) or format_table)(result))
    # A bench that found wrong outputs or leaked state says so and fails, after its figures.
    problems = result.get("problems") or []
    for problem in problems:
        print(f"kvtier: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def format_table(result: dict[str, Any]) -> str:
    width = max(len(k) for k in result)
    lines = []
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)
