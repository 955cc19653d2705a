"""kvtier inside vLLM: a v1 KV connector (``KVTierConnector``).

Use it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KVTierConnector",
        "kv_connector_module_path":"kvtier.integrations.vllm","kv_role":"kv_both"}'

or, with ``kvtier[vllm]`` installed, by name alone (``"kv_connector":"KVTierConnector"``):
kvtier registers it through vLLM's ``vllm.general_plugins`` entry point (:mod:`.plugin`).

Where the cache lives
---------------------
vLLM runs the connector twice: the scheduler side in the engine-core process, the worker
side in each worker process (on the CPU build even a single worker is its own process). The
KV lives in the worker; so does kvtier's Engine, and with it every pin::

    engine-core process                          worker process (one per TP rank)
    ┌──────────────────────────────┐             ┌──────────────────────────────────────┐
    │ vLLM scheduler               │             │ vLLM model runner                    │
    │  KVTierConnector (SCHEDULER) │  metadata   │  KVTierConnector (WORKER)            │
    │   SchedulerSide ─────────────┼─ per step ─▶│   WorkerSide                         │
    │    lookup(rid, tokens) ──────┼── socket ──▶│    Engine  (CPU pages, disk, Redis,  │
    │    end(rid) ─────────────────┼── socket ──▶│             leases keyed by vLLM rid)│
    │   no KV, no pins             │             │    PagedKV (vLLM blocks <-> chunks)  │
    └──────────────────────────────┘             └──────────────────────────────────────┘

Why the worker owns it: the bytes move between kvtier's pages and vLLM's paged blocks every
step, and that copy must be a local memory copy (or a device copy on GPU), never a trip
between processes. Each tensor-parallel rank holds its own slice of every head, so each rank
owns its own Engine (the rank is part of the key fingerprint). The scheduler only needs a
number (the hit) and a way to end a request; both are small messages on a Unix socket
(:mod:`.channel`). The pin taken by a lookup sits in the lease of the Engine that holds the
data, and the scheduler ends it exactly once, from ``request_finished``, which vLLM calls once
for every request however it ends (finished, length-capped, aborted while running or waiting,
failed load). It does not wait for a step, so an abort on an idle engine releases at once. A
preempted request keeps its lease: those chunks are what it reloads on resume. Shutdown closes
the Engine, which ends every lease still open.

The other design, the scheduler owning the Engine, would put the pins next to the decisions
but the bytes a process away from the blocks they fill; with shared memory it could work, and
it is what a host-wide kvtier server does (DESIGN.md), but it is not the simplest correct
design for one vLLM instance.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing this package (or a module in it) does not import vLLM.
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
