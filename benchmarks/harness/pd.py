"""Prefill/decode disaggregation behind vllm-router, as docs/fleet.md documents it: each side's
``--kv-transfer-config`` and the router's PD command read from the doc's own blocks (so the
benchmark runs what an operator copies), and what kvtier's workers say about their transfers.

::

    client ──▶ vllm-router (PD) ──prompt, max_tokens 1──▶ prefiller i (holds the chunks)
                 │        ◀── kv_transfer_params {kvtier_transfer_id, remote_host/port} ──┘
                 └──the client's body + those params──▶ decoder j ──pulls them──▶ prefiller i

A prefiller's lookup channel reports its send buffer (``pd_source``: address, transfers held,
chunks held or shared, transfers served, claims refused, transfers expired); a decoder's its
pulls (``pd_pulls``: count, failures, the latest as (transfer id, "host:port", chunks, ok)).
A transfer id starts with the engine id of the prefiller that named it.
"""

from __future__ import annotations

import itertools
import json
import shlex
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.docs import block_after
from benchmarks.harness.router import router_binary
from benchmarks.harness.vllm_server import free_port
from kvtier.integrations.vllm.rpc import LookupClient

DOC = "docs/fleet.md"


def documented_transfer(side: str, engine_id: str, **extra: Any) -> dict[str, Any]:
    """docs/fleet.md's ``--kv-transfer-config`` for ``side`` ("xPyD prefiller", "xPyD
    decoder"), with ``engine_id`` and ``extra`` (sizes scaled to the model) replacing the
    doc's values; the rest as written."""
    config = json.loads(block_after(DOC, f"The {side}'s", "json"))
    config["kv_connector_extra_config"].update(extra)
    return {**config, "engine_id": engine_id}


def documented_router(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], port: int
) -> list[str]:
    """docs/fleet.md's xPyD vllm-router command with this fleet's workers (any number of each,
    where the doc names two) and port, plus metrics on a free port and a starting worker
    noticed within a second."""
    script = block_after(DOC, "### Any prefiller to any decoder", "bash")
    [line] = [line for line in script.splitlines() if line.startswith("vllm-router ")]
    words = shlex.split(line)[1:]
    command = [router_binary()]
    workers = [*(("--prefill", u) for u in prefill_urls), *(("--decode", u) for u in decode_urls)]
    skip = False
    for before, word in itertools.pairwise(["", *words]):
        if skip:
            skip = False
        elif word in ("--prefill", "--decode"):
            skip = True  # the doc's worker URL follows; ours go in once, at the first
            command += [w for pair in workers for w in pair]
            workers = []
        else:
            command.append(str(port) if before == "--port" else word)
    return command + ["--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"]


def stats_of(engine_id: str) -> dict[str, Any]:
    """The kvtier stats of the vLLM worker whose engine id is ``engine_id`` (its lookup
    channel, on this host)."""
    client = LookupClient(engine_id)
    try:
        return client.stats()
    finally:
        client.close()


def problems(engine_ids: Sequence[str]) -> list[str]:
    """What is still held anywhere, as sentences (empty: every buffer free): failed
    invariants, leaked leases, pinned pages, transfers in a send buffer, bytes in a receive
    buffer."""
    found: list[str] = []
    for engine_id in engine_ids:
        client = LookupClient(engine_id)
        try:
            stats = client.stats()
            found += [f"{engine_id}: {p}" for p in client.check()]
            found += [f"{engine_id}: leak {leak}" for leak in client.leaks()]
        finally:
            client.close()
        if stats["pinned_pages"]:
            found.append(f"{engine_id}: {stats['pinned_pages']} pinned pages")
        source = stats.get("pd_source")
        if source is not None and (source["used_bytes"] or source["transfers"]):
            found.append(f"{engine_id}: send buffer holds {source['transfers']} transfers")
        pd = stats["tiers"].get("pd")
        if pd is not None and pd["used_bytes"]:
            found.append(f"{engine_id}: receive buffer holds {pd['used_bytes']} bytes")
    return found


def settled_problems(engine_ids: Sequence[str], wait_s: float) -> list[str]:
    """:func:`problems`, asked again for up to ``wait_s`` until there are none (a prefiller
    frees a transfer right after its decoder's last byte)."""
    deadline = time.monotonic() + wait_s
    while (found := problems(engine_ids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found
