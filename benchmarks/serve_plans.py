"""The cache configurations of ``python -m benchmarks serve`` (the table in
:mod:`benchmarks.serve`): how each starts vLLM, and what it needs beside it (a Redis, a
``kvtier server``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIGS = ("none", "apc", "cpu", "disk", "redis", "server", "example")
FRESH = {"disk", "redis", "server"}  # pass 2 in a new vLLM process
# kvtier's configurations and the tier each must serve its measured pass from (None: any)
KVTIER_CONFIGS = {"cpu": "cpu", "disk": "disk", "redis": "redis", "server": None}
KVTIER = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


@dataclass
class Plan:
    """One configuration: how to start vLLM (and what it needs beside it)."""

    name: str
    prefix_cache: bool = False
    transfer: dict[str, Any] | None = None
    fresh: bool = False
    needs_redis: bool = False
    needs_server: bool = False
    env: dict[str, str] = field(default_factory=dict)


def plan_for(
    name: str,
    work: Path,
    cpu_size: str,
    redis_url: str = "",
    sock: str = "",
    chunk_size: int | None = None,
    save_decode_cache: bool | None = None,
    codec: str | None = None,
) -> Plan:
    """The vLLM settings of configuration ``name`` (the table in :mod:`benchmarks.serve`);
    ``chunk_size``: kvtier's chunk (None: kvtier's default); ``save_decode_cache``: whether
    kvtier also stores the answers, what the conversation workload's next rounds reuse
    (None: kvtier's default); ``codec``: the payload codec of the disk configuration's disk
    tier and the redis configuration's Redis tier (the CPU tier has none)."""
    if name == "none":
        return Plan(name)
    if name == "apc":
        return Plan(name, prefix_cache=True)
    if name == "cpu":
        extra: dict[str, Any] = {"max_local_cpu_size": cpu_size}
    elif name == "disk":
        extra = {
            "local_cpu": False,
            "max_local_cpu_size": cpu_size,
            "local_disk": str(work / "disk"),
            "max_local_disk_size": "32GiB",
        }
    elif name == "redis":
        extra = {"local_cpu": False, "max_local_cpu_size": cpu_size, "remote_url": redis_url}
    elif name == "server":
        extra = {"server": f"unix://{sock}"}
    elif name == "example":
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(work / "example")},
        }
        return Plan(name, transfer=transfer)
    else:
        raise ValueError(f"configuration {name!r} is unknown; use {', '.join(CONFIGS)}")
    if chunk_size is not None:
        extra["chunk_size"] = chunk_size
    if save_decode_cache is not None:
        extra["save_decode_cache"] = save_decode_cache
    if codec is not None and name in ("disk", "redis"):
        extra["disk_codec" if name == "disk" else "remote_codec"] = codec
    transfer = {**KVTIER, "kv_connector_extra_config": extra}
    return Plan(
        name,
        transfer=transfer,
        fresh=name in FRESH,
        needs_redis=name == "redis",
        needs_server=name == "server",
    )
