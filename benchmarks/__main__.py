"""``python -m benchmarks NAME [--json]``: the serving-stack benchmarks, printed as
``kvtier bench`` prints its own (a table, or one JSON object)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvtier.cli import bench

BENCHMARKS: dict[str, str] = {
    "ttft": "time to first token with 0, 50 and 90 percent of the prompt cached (transformers)",
    "vllm": "time to first token inside vLLM: cold, vLLM's prefix cache, kvtier CPU and disk",
    "serve": "vLLM's serving benchmark per cache configuration: TTFT efficiency, throughput",
    "families": "bytes stored per token per KV-cache group kind vs naive full KV, per family; "
    "state families: tokens reused through kvtier vs vLLM's prefix cache",
    "fleet": "2 vLLM behind vllm-router: prefill computed vs ideal per policy, with/without kvtier",
    "replicas": "2 vLLM replicas on one host sharing one kvtier server vs a CPU tier each and "
    "vLLM alone: prefill computed vs ideal, TTFT on the replica that never saw a prefix",
    "fleet-share": "N kvtier servers, one engine each: prefill computed vs ideal with no "
    "sharing, Redis, S3 and P2P",
    "pd-fleet": "xPyD behind vllm-router (PD), concurrent: TTFT, tokens/s vs 1P1D and one vLLM",
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    bench.add_parser(parser, BENCHMARKS, "benchmarks")
    return bench.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
