"""``python -m benchmarks pd-fleet``'s arguments, requests and the documented configs it runs
(fast: no vLLM; the fleet itself runs in tests/integrations/vllm/test_pd_router.py)."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest
from benchmarks.harness.docs import block_after
from benchmarks.harness.pd import documented_router, documented_transfer
from benchmarks.pd_fleet import add_arguments, parse_fleets, prompts


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_fleets_parse_as_prefillers_and_decoders() -> None:
    assert args().fleets == [(2, 2), (1, 1)]
    assert parse_fleets("3p1d, 1P2D") == [(3, 1), (1, 2)]
    for bad in ("2P", "0P1D", "2x2", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="xPyD"):
            parse_fleets(bad)


def test_requests_share_prefixes_and_end_in_their_own_tails() -> None:
    a = args("--requests", "8", "--prefixes", "2", "--prefix-tokens", "20")
    trace = prompts(a)
    assert len(trace) == 8
    assert [len(p) - 20 for p in trace] == [40 + (i * 53) % 200 for i in range(8)]
    assert trace[0][:20] == trace[2][:20] != trace[1][:20]
    assert trace[0][20:] != trace[2][20:]
    assert min(min(p) for p in trace) >= 3  # every id has a word (words_for)
    assert prompts(a) == trace


def test_the_fleet_runs_the_documented_configs_and_router_command() -> None:
    transfer = documented_transfer("xPyD decoder", "d-7", pd_buffer_size="64MiB")
    doc = json.loads(block_after("docs/fleet.md", "The xPyD decoder's", "json"))
    assert transfer["engine_id"] == "d-7" and transfer["kv_role"] == doc["kv_role"]
    assert transfer["kv_connector_extra_config"] == {
        **doc["kv_connector_extra_config"],
        "pd_buffer_size": "64MiB",
    }
    command = documented_router(["http://p1", "http://p2", "http://p3"], ["http://d1"], 9001)
    pairs = list(itertools.pairwise(command))
    assert [b for a, b in pairs if a == "--prefill"] == ["http://p1", "http://p2", "http://p3"]
    assert [b for a, b in pairs if a == "--decode"] == ["http://d1"]
    assert ("--port", "9001") in pairs and "--vllm-pd-disaggregation" in command
    assert ("--prefill-policy", "round_robin") in pairs  # the rest as the doc writes it
