"""``python -m kvtier.bench.trace_matrix``: every policy against LRU, ARC and the optimum on
every trace (the shipped conversation trace and the synthetic shapes) at every capacity.

Issue 49's bar for ``REUSE`` reads off this table: at no point more than 0.002 below the
better of LRU and ARC. A point is one replay (:func:`kvtier.bench.trace.point`'s references,
and kvtier's real CPU tier for each policy asked for); the whole matrix is 8 traces x 6
capacities, a few minutes on one core, so it runs in pieces (``--traces``, ``--capacities``,
``--policies``) and keeps each figure in ``--cache`` (a JSON file a point) under a key that
names the trace's content and the source of the code that made it: edit the policy and only
its replays run again. The references are the bench's (every block stored, as the peers
do; ``lru_whole``: LRU that, as kvtier, never stores a partial block).

Output: a Markdown table (``--json``: the figures), each policy's ``margin`` (its hit ratio
minus the better of LRU and ARC) and the least margin over the matrix. ``--seed N`` replays
another draw of the synthetic shapes: constants chosen on the default draw are checked on
one they were not chosen on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from kvtier.bench import trace as trace_bench
from kvtier.bench import trace_sims, trace_synthetic
from kvtier.bench.trace_file import DEFAULT, Trace, load
from kvtier.storage import policy as policy_package

TRACES = (DEFAULT, *trace_synthetic.SHAPES)
CACHE = Path("/tmp/kvtier-trace-matrix")
REFERENCES = ("lru", "arc", "opt", "lru_whole")


@cache
def _trace(name: str, seed: int | None = None) -> Trace:
    """Trace ``name``; ``seed`` draws a synthetic shape afresh (a shipped trace ignores it)."""
    if name in trace_synthetic.SHAPES:
        return trace_synthetic.generate(name, seed)
    return load(name)


@cache
def _trace_digest(name: str, seed: int | None = None) -> str:
    """A digest of the trace's block ids and tokens: a figure is kept for this very trace."""
    digest = hashlib.sha256()
    tr = _trace(name, seed)
    for ids, tokens in zip(tr.requests, tr.tokens, strict=True):
        digest.update(repr((ids, tokens)).encode())
    return digest.hexdigest()[:12]


@cache
def _source_digest(*modules: str) -> str:
    """A digest of the files of ``modules`` (dotted names, or a package's every file)."""
    digest = hashlib.sha256()
    for name in modules:
        module = sys.modules[name]
        path = Path(module.__file__ or "")
        files = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
        for file in files:
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _reference(kind: str, tr: Trace, blocks: int) -> float:
    caches: dict[str, Callable[[], trace_sims.ReplayCache]] = {
        "lru": lambda: trace_sims.Lru(blocks),
        "arc": lambda: trace_sims.Arc(blocks),
        "opt": lambda: trace_sims.Optimum(blocks, tr),
        "lru_whole": lambda: trace_sims.Lru(blocks, tr.block_tokens),
    }
    return trace_sims.replay(tr, caches[kind]())


def figure(
    name: str, fraction: float, kind: str, cache_dir: Path | None, seed: int | None = None
) -> float:
    """The hit ratio of ``kind`` (a reference or a ``cache_policy`` name) on trace ``name``
    (drawn with ``seed``) at ``fraction`` of its unique blocks, from ``cache_dir`` when made
    by the same code from the same trace."""
    is_policy = kind in policy_package.POLICIES
    code = _source_digest(policy_package.__name__ if is_policy else trace_sims.__name__)
    if is_policy:  # the replay through the real CPU tier
        code += _source_digest(trace_bench.__name__, "kvtier.storage.cpu")[:8]
    key = f"{name}-{fraction:g}-{kind}-{_trace_digest(name, seed)}-{code}"
    path = cache_dir / f"{key}.json" if cache_dir else None
    if path is not None and path.is_file():
        return float(json.loads(path.read_text())["hit_ratio"])
    tr = _trace(name, seed)
    blocks = max(1, int(fraction * tr.unique_blocks()))
    started = time.perf_counter()
    real = is_policy  # kvtier's CPU tier, or a reference simulation
    ratio = trace_bench.cpu_ratio(tr, blocks, kind) if real else _reference(kind, tr, blocks)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        seconds = time.perf_counter() - started
        path.write_text(json.dumps({"hit_ratio": ratio, "seconds": seconds}))
    return ratio


def matrix(
    traces: Sequence[str],
    capacities: Sequence[float],
    policies: Sequence[str],
    cache_dir: Path | None,
    seed: int | None = None,
) -> dict[str, Any]:
    rows = []
    for name in traces:
        for fraction in capacities:
            row: dict[str, Any] = {"trace": name, "capacity": fraction}
            for kind in (*policies, *REFERENCES):
                row[kind] = figure(name, fraction, kind, cache_dir, seed)
            peer = max(row["lru"], row["arc"])
            for p in policies:
                row[f"{p}_margin"] = row[p] - peer
            rows.append(row)
    least = {p: min((r[f"{p}_margin"] for r in rows), default=0.0) for p in policies}
    return {"rows": rows, "least_margin": least}


def markdown(result: dict[str, Any], policies: Sequence[str]) -> str:
    head = [
        "trace",
        "capacity",
        *policies,
        "LRU",
        "ARC",
        "optimum",
        *[f"{p} - peer" for p in policies],
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in result["rows"]:
        cells = [r["trace"], f"{r['capacity']:.0%}"]
        cells += [f"{r[p]:.4f}" for p in policies]
        cells += [f"{r['lru']:.4f}", f"{r['arc']:.4f}", f"{r['opt']:.4f}"]
        cells += [f"{r[f'{p}_margin']:+.4f}" for p in policies]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated names")
    parser.add_argument(
        "--capacities",
        default=",".join(f"{c:g}" for c in trace_bench.CURVE),
        help="comma-separated fractions of each trace's unique blocks",
    )
    parser.add_argument("--policies", default="REUSE", help="comma-separated cache_policy names")
    parser.add_argument("--cache", type=Path, default=CACHE, help="a JSON file a figure")
    parser.add_argument("--no-cache", action="store_true", help="replay every point again")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="draw the synthetic shapes with this seed (a held-out draw; default: each "
        "shape's own); the conversation trace is the same whatever the seed",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in policy_package.POLICIES]
    if unknown:
        parser.error(f"--policies {unknown}: valid are {sorted(policy_package.POLICIES)}")
    result = matrix(
        args.traces.split(","),
        [float(c) for c in args.capacities.split(",")],
        policies,
        None if args.no_cache else args.cache,
        args.seed,
    )
    print(json.dumps(result) if args.json else markdown(result, policies))
    if not args.json:
        print(
            "\nleast margin: "
            + ", ".join(f"{p} {m:+.4f}" for p, m in result["least_margin"].items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
