"""Lab script (not part of kvtier): what one CPU-tier eviction costs with most entries pinned.

Fills a CPU tier of 100k pages, pins the oldest 90k (one more page reference each, as a
request's lease or a lower-tier write holds them), then times ``allocate(1)`` on the full
pool, each call evicting one victim (its page then cached under a new key, so the pool stays
full): the first eviction (where the policy meets the pinned entries), and the median and
worst of the ones after it. The same with nothing pinned, for each policy. Wall-clock
figures on a shared machine: each is the least of ``--repeat`` runs.

    PYTHONPATH=src .venv/bin/python scripts/eviction_pins.py [--entries 100000] [--pinned 0.9]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvtier.memory.block_pool import BlockPool
from kvtier.storage.cpu import CpuTier
from kvtier.storage.policy import POLICIES, make_policy

PAGE_BYTES = 64


def measure(policy: str, entries: int, pinned: int, evictions: int) -> tuple[float, list[float]]:
    """(first eviction, the ``evictions`` after it), in milliseconds."""
    pool = BlockPool(entries, PAGE_BYTES)
    tier = CpuTier(pool, lambda _: PAGE_BYTES, make_policy(policy))
    serial = 0

    def store(page: int) -> None:
        nonlocal serial
        serial += 1
        assert tier.insert(serial.to_bytes(16, "little"), page, 16)

    for page in pool.allocate(entries) or []:
        store(page)
    held = list(range(pinned))  # pages are allocated in order: these are the oldest entries
    pool.retain(held)
    times: list[float] = []
    for _ in range(evictions + 1):
        start = time.perf_counter()
        got = tier.allocate(1)
        times.append((time.perf_counter() - start) * 1e3)
        assert got is not None, "nothing evictable"
        store(got[0])
    pool.release(held)
    tier.close()
    pool.close()
    return times[0], times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--pinned", type=float, default=0.9, help="share of entries pinned")
    parser.add_argument("--evictions", type=int, default=50, help="timed after the first")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the least is reported")
    args = parser.parse_args()
    for policy in sorted(POLICIES):
        for share in (0.0, args.pinned):
            pinned = int(share * args.entries)
            runs = [
                measure(policy, args.entries, pinned, args.evictions) for _ in range(args.repeat)
            ]
            first = min(f for f, _ in runs)
            rest = min((r for _, r in runs), key=statistics.median)
            print(
                f"{policy:6} {pinned:>7} of {args.entries} pinned: first {first:8.3f} ms, "
                f"then median {statistics.median(rest):8.4f} ms, max {max(rest):8.3f} ms"
            )


if __name__ == "__main__":
    main()
