"""``kvtier check-config [FILE]``: the resolved config, where each value came from, the sizes
that follow from it for a given layout, every key that loads but does nothing, and every
problem at once: each bad value, each broken rule between keys, and what the probes of
:mod:`kvtier.cli.config_probes` found (a Redis, an S3 bucket or a P2P peer that does not
answer or refuses the credentials, a disk directory that cannot be written, a memory size
above the machine's, a PD buffer device this build has not). Exit 2 when there is a problem.

Each key is reported once: a key that failed at load is not probed (its value is then the
default, not the one given), and where check-config's own checks find more about a key that
failed at load (a size too small for one chunk), that is added to the same line. A size
LMCache reads as GB gets a note saying which reading it got, as the engine's start line does.

It answers in about a second, and within :data:`~kvtier.cli.config_probes.NETWORK_TIMEOUT_S`
more when a store or peer it probes does not answer (those probes run at once, each with its
own deadline). Torch is imported only for what needs it (a ``cpu_codec``'s slot sizes, a tier
URL scheme other than Redis's, s3's and local_disk's); the plain sizes are arithmetic on
the layout's numbers, the same as :meth:`KVLayout.chunk_bytes` (a test keeps them equal).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from kvtier.cli.config_probes import is_redis_url, probe_all
from kvtier.cli.probes_s3 import s3_client_installed
from kvtier.config import Config
from kvtier.config.effects import keys_with_no_effect
from kvtier.config.schema import KEYS
from kvtier.config.sizes import GIB, GIB_NUMBER_KEYS, format_size, size_note
from kvtier.errors import ConfigError

# torch dtype name -> bytes per element, for the sizes computed without importing torch.
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
KV_PLANES = 2  # K and V


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        help="YAML or JSON file (JSON is YAML too: vLLM's --kv-transfer-config "
        "kv_connector_extra_config saved as a file works; default: $KVTIER_CONFIG_FILE or "
        "$LMCACHE_CONFIG_FILE)",
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
    ignored: dict[str, str] = {}  # LMCache keys given that kvtier drops at load
    config, errors = Config.diagnose(args.file, ignored=ignored)
    if config is None:  # no config to show: the file unreadable, not YAML, not a mapping
        raise errors[-1]
    failed_at_load = frozenset(error.key for error in errors)
    checked: list[str] = []
    for what, error in probe_all(config, skip=failed_at_load):
        if error is None:
            checked.append(f"{what}: ok")
        else:
            errors.append(error)
    derived: dict[str, object] = {}
    try:
        derived = derived_sizes(config, args)
    except ConfigError as exc:
        errors.append(exc)
    try:
        if "remote_url" not in failed_at_load:  # its load error says what is valid already
            _check_tier_urls(config)
    except ConfigError as exc:
        errors.append(exc)
    errors = _one_per_key(errors)
    notes = size_notes(config)
    no_effect = {**keys_with_no_effect(config), **ignored}
    values = config.as_dict()
    if args.json:
        out: dict[str, Any] = {"config": values, "origin": dict(config.origin)}
        out |= {"derived": derived, "checked": checked, "no_effect": no_effect}
        out |= {"notes": notes, "errors": [str(e) for e in errors]}
        print(json.dumps(out, default=str))
    else:
        _print_text(config, values, derived, checked, no_effect)
        for note in notes:
            print(f"note: {note}")
    for error in errors:
        print(f"kvtier: error: {error}", file=sys.stderr)
    if errors:
        print(f"kvtier check-config: {len(errors)} problem(s)", file=sys.stderr)
    return 2 if errors else 0


def derived_sizes(config: Config, args: argparse.Namespace) -> dict[str, object]:
    """The sizes that follow from the config for the layout the arguments give."""
    dtype_bytes = DTYPE_BYTES.get(args.dtype)
    if config.cpu_codec != "identity" or dtype_bytes is None:
        return _derived_with_torch(config, args)
    token_bytes = KV_PLANES * args.layers * args.kv_heads * args.head_dim * dtype_bytes
    chunk_bytes = token_bytes * config.chunk_size
    derived: dict[str, object] = {
        "layout": f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} head "
        f"dim, {args.dtype}",
        "chunk_bytes": chunk_bytes,
    }
    cpu = _whole_chunks("max_local_cpu_size", config.max_local_cpu_size, chunk_bytes, config)
    derived["cpu_chunks"] = cpu
    derived["cpu_bytes_used"] = cpu * chunk_bytes
    _lower_tier_sizes(config, chunk_bytes, derived)
    return derived


def _derived_with_torch(config: Config, args: argparse.Namespace) -> dict[str, object]:
    import torch

    from kvtier.layout import KVLayout
    from kvtier.tiers import cpu_capacity

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("--dtype", args.dtype, f"a torch dtype: {', '.join(DTYPE_BYTES)}")
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, dtype)
    chunk_bytes = layout.chunk_bytes(config.chunk_size)
    derived: dict[str, object] = {"layout": layout.describe(), "chunk_bytes": chunk_bytes}
    cpu = cpu_capacity(config, layout)
    derived["cpu_chunks"] = cpu.chunks  # at least: a lossless chunk may take fewer slots
    derived["cpu_bytes_used"] = cpu.bytes_used
    if cpu.slots:  # a cpu_codec: staging pages plus the coded store
        derived["cpu_codec"] = cpu.codec
        derived["cpu_staging_chunks"] = cpu.staging_pages
        derived["cpu_coded_slots"] = f"{cpu.slots} x {cpu.slot_bytes} bytes"
    _lower_tier_sizes(config, chunk_bytes, derived)
    return derived


def _lower_tier_sizes(config: Config, chunk_bytes: int, derived: dict[str, object]) -> None:
    if config.local_disk:
        from kvtier.config.local_disk import parse_local_disk

        derived["disk_directory"] = parse_local_disk(config.local_disk)
        derived["disk_chunks"] = _whole_chunks(
            "max_local_disk_size", config.max_local_disk_size, chunk_bytes, config
        )
    if config.enable_pd and config.pd_buffer_size is not None:
        pages = _whole_chunks("pd_buffer_size", config.pd_buffer_size, chunk_bytes, config)
        derived["pd_buffer_chunks"] = pages
        derived["pd_buffer_bytes_used"] = pages * chunk_bytes


def _whole_chunks(key: str, capacity: int, chunk_bytes: int, config: Config) -> int:
    """As the engine counts a capacity (``pages_for_capacity``): whole chunks, at least one."""
    if capacity < chunk_bytes:
        raise ConfigError(
            key,
            capacity,
            f"at least one chunk ({chunk_bytes} bytes = {format_size(chunk_bytes)}) for this "
            f"model layout and chunk_size{_suggestion(key, chunk_bytes, config)}",
        )
    return capacity // chunk_bytes


DISK_SHARE = 2  # a suggested disk tier takes at most half of the filesystem's free space


def _suggestion(key: str, chunk_bytes: int, config: Config) -> str:
    """A value to write, for the disk size: from the free space where the directory is."""
    if key != "max_local_disk_size" or not config.local_disk:
        return ""
    from kvtier.config.local_disk import parse_local_disk

    where = parse_local_disk(config.local_disk)
    existing = where
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return ", e.g. max_local_disk_size: 20 (GiB, as LMCache reads a bare number)"
    gib = max(free // DISK_SHARE // GIB, 1)
    return (
        f", e.g. max_local_disk_size: {gib} (GiB, as LMCache reads a bare number: at most half "
        f"of the {format_size(free)} free on {existing}'s filesystem)"
    )


def _check_tier_urls(config: Config) -> None:
    """A URL scheme no tier is registered for. Redis's grammar was checked at load and
    local_disk's by :func:`parse_local_disk`, and ``s3://`` is probed with the s3 tier's own
    options and client; any other remote_url scheme asks the registry (which imports the
    tiers, and torch)."""
    if not config.remote_url or is_redis_url(config.remote_url):
        return
    if config.remote_url.split("://", 1)[0].lower() == "s3" and s3_client_installed():
        return  # the S3 probe built the tier's own options and client: the scheme is served
    from kvtier.tiers import check_tier_urls

    check_tier_urls(config)


def _one_per_key(errors: list[ConfigError]) -> list[ConfigError]:
    """Each key and value once, in the order first met: a refused LMCache value is met again
    when its key is parsed (the same line), and a size found too small at load is found again
    by the chunk count, which adds what load does not know (the chunk's size, a value to
    write): later lines on a key and value add their words to its first line. (Two values of
    one key, two peers of ``p2p_peers``, stay two lines.)"""
    by_key: dict[tuple[str, str], ConfigError] = {}
    for error in errors:
        first = by_key.get((error.key, repr(error.value)))
        if first is None:
            by_key[(error.key, repr(error.value))] = error
        elif error.allowed not in first.allowed:
            by_key[(error.key, repr(error.value))] = ConfigError(
                first.key, first.value, f"{first.allowed}; {error.allowed}"
            )
    return list(by_key.values())


def size_notes(config: Config) -> list[str]:
    """One note per size LMCache reads as GB, given in the config (the engine's start line
    says the same of every such size): which reading it got, and the other one."""
    keys = [k for k in GIB_NUMBER_KEYS if k in config.origin]
    if not config.local_disk:
        keys = [k for k in keys if k != "max_local_disk_size"]
    return [size_note(key, getattr(config, key), config.origin) for key in keys]


def _print_text(
    config: Config,
    values: dict[str, Any],
    derived: dict[str, object],
    checked: list[str],
    no_effect: dict[str, str],
) -> None:
    width = max(len(k) for k in values)
    for key, value in values.items():
        source = config.origin.get(key, "default")
        shown = f"{value} ({format_size(value)})" if key.startswith("max_") else repr(value)
        mark = f"  NO EFFECT: {no_effect[key]}" if key in no_effect else ""
        print(f"{key:<{width}}  {shown:<32} {source}{mark}")
    print()
    for key, value in derived.items():
        print(f"{key:<{width}}  {value}")
    for line in checked:
        print(f"checked: {line}")
    for key, why in no_effect.items():
        if key not in values:  # an LMCache key kvtier dropped: no row above to mark
            print(f"{key:<{width}}  NO EFFECT: {why}")


def key_table() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for spec in KEYS:
        default = "(none)" if spec.default is None else f"`{spec.default}`"
        name = spec.name if spec.lmcache else f"{spec.name} (kvtier)"
        rows.append(f"| `{name}` | {default} | {spec.doc} |")
    return "\n".join(rows)
