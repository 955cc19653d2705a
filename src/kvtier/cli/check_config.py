"""``kvtier check-config [FILE]``: the resolved config, where each value came from, and the
sizes that follow from it for a given layout."""

from __future__ import annotations

import argparse
import json

import torch

from kvtier.config import Config
from kvtier.config.schema import KEYS
from kvtier.config.sizes import format_size
from kvtier.layout import KVLayout
from kvtier.memory.block_pool import pages_for_capacity
from kvtier.storage.disk.options import check_directory, options_from_config
from kvtier.tiers import check_tier_urls, cpu_capacity


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", nargs="?", help="YAML file (default: $KVTIER_CONFIG_FILE or $LMCACHE_CONFIG_FILE)"
    )
    parser.add_argument(
        "--layers", type=int, default=32, help="model layers for derived sizes (32)"
    )
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (128)")
    parser.add_argument("--dtype", default="bfloat16", help="KV dtype (bfloat16)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--table", action="store_true", help="print the config-key table (Markdown)"
    )


def run(args: argparse.Namespace) -> int:
    if args.table:
        print(key_table())
        return 0
    config = Config.load(args.file)
    check_tier_urls(config)  # a URL scheme no tier is registered for (s3:// unregistered)
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, getattr(torch, args.dtype))
    chunk_bytes = layout.chunk_bytes(config.chunk_size)
    derived: dict[str, object] = {"layout": layout.describe(), "chunk_bytes": chunk_bytes}
    cpu = cpu_capacity(config, layout)
    derived["cpu_chunks"] = cpu.chunks  # at least: a lossless chunk may take fewer slots
    derived["cpu_bytes_used"] = cpu.bytes_used
    if cpu.slots:  # a cpu_codec: staging pages plus the coded store
        derived["cpu_codec"] = cpu.codec
        derived["cpu_staging_chunks"] = cpu.staging_pages
        derived["cpu_coded_slots"] = f"{cpu.slots} x {cpu.slot_bytes} bytes"
    if config.local_disk:
        # What the engine's disk tier will check at construction and open (nothing created)
        disk = options_from_config(config, layout, config.chunk_size)
        check_directory(disk.path)
        derived["disk_directory"] = disk.path
        derived["disk_chunks"] = config.max_local_disk_size // chunk_bytes
    if config.enable_pd and config.pd_buffer_size is not None:
        pd_pages = pages_for_capacity("pd_buffer_size", config.pd_buffer_size, chunk_bytes)
        derived["pd_buffer_chunks"] = pd_pages
        derived["pd_buffer_bytes_used"] = pd_pages * chunk_bytes
    values = config.as_dict()
    if args.json:
        print(
            json.dumps(
                {"config": values, "origin": dict(config.origin), "derived": derived}, default=str
            )
        )
        return 0
    width = max(len(k) for k in values)
    for key, value in values.items():
        source = config.origin.get(key, "default")
        shown = f"{value} ({format_size(value)})" if key.startswith("max_") else repr(value)
        print(f"{key:<{width}}  {shown:<32} {source}")
    print()
    for key, value in derived.items():
        print(f"{key:<{width}}  {value}")
    return 0


def key_table() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for spec in KEYS:
        default = "(none)" if spec.default is None else f"`{spec.default}`"
        name = spec.name if spec.lmcache else f"{spec.name} (kvtier)"
        rows.append(f"| `{name}` | {default} | {spec.doc} |")
    return "\n".join(rows)
