"""``python -m kvtier.bench.policy_cost``: what an eviction policy costs a key, in microseconds.

A policy holding ``C`` keys (its panel started, some turnover behind it) is timed on the two
calls a tier makes most, one thread, the best of ``--repeats`` runs::

    touch    lookups of 512 cached keys each (random ones: a lookup's batch)   us a key touched
    store    a new key inserted, then one victim evicted (a full cache)      us a key stored

The policy alone, without the tier's index or pages: what docs/policies.md's cost table
shows. ``--json`` prints the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence

from kvtier.keys import ChunkKey
from kvtier.storage.policy import POLICIES, EvictionPolicy, make_policy

LOOKUP_KEYS = 512
LOOKUPS = 40
STORES = 5_000
WARM_STORES = 2_000  # turnover before timing: ghosts, shadows and the rule in play


def _key(n: int) -> ChunkKey:
    return n.to_bytes(16, "little")


def _anything(_: ChunkKey) -> bool:
    return True


def _filled(name: str, keys: int) -> tuple[EvictionPolicy, int]:
    """A policy of ``keys`` cached keys after ``WARM_STORES`` stores; the next new key."""
    policy = make_policy(name)
    for n in range(keys):
        policy.insert(_key(n))
    for n in range(keys, keys + WARM_STORES):
        policy.insert(_key(n))
        policy.evict(1, _anything)
    return policy, keys + WARM_STORES


def cost(name: str, keys: int, seed: int = 0) -> dict[str, float]:
    """One run: microseconds a key for ``touch`` and for a store (insert + one eviction)."""
    policy, next_key = _filled(name, keys)
    rng = random.Random(seed)
    cached = list(policy.order())
    lookups = [rng.sample(cached, min(LOOKUP_KEYS, len(cached))) for _ in range(LOOKUPS)]
    started = time.perf_counter()
    for batch in lookups:
        policy.touch(batch)
    touch = (time.perf_counter() - started) / sum(map(len, lookups))
    started = time.perf_counter()
    for n in range(next_key, next_key + STORES):
        policy.insert(_key(n))
        policy.evict(1, _anything)
    store = (time.perf_counter() - started) / STORES
    assert len(policy) == keys, "a store and its eviction leave the policy's size as it was"
    return {"touch_us": touch * 1e6, "store_us": store * 1e6}


def table(policies: Sequence[str], sizes: Sequence[int], repeats: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for keys in sizes:
        for name in policies:
            runs = [cost(name, keys, seed) for seed in range(repeats)]
            row: dict[str, object] = {"policy": name, "keys": keys}
            row.update({k: min(run[k] for run in runs) for k in ("touch_us", "store_us")})
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="LRU,REUSE", help="comma-separated names")
    parser.add_argument("--keys", default="2000,20000,200000", help="comma-separated sizes")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (the best)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"--policies {unknown}: valid are {sorted(POLICIES)}")
    rows = table(policies, [int(k) for k in args.keys.split(",")], max(1, args.repeats))
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| keys | policy | touch, us a key | store, us a key |\n|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['keys']:,} | {r['policy']} | {r['touch_us']:.2f} | {r['store_us']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
