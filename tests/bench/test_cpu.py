"""``kvtier bench cpu``: every field, and a failure (not a figure) when the timed retrieve
path writes wrong bytes or none."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvtier.bench import cpu
from kvtier.lease import Lease
from kvtier.storage.loads import PlanLoader
from kvtier.storage.lookup import LookupPlan
from tests.bench.bench_checks import assert_spread
from tests.cli.test_main import run_cli


def test_bench_cpu_prints_every_field() -> None:
    result = run_cli(
        "bench", "cpu", "--json", "--chunks", "2", "--repeats", "1", "--chunk-size", "16"
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for field in (
        "chunk_bytes",
        "store_gbps",
        "retrieve_gbps",
        "memcpy_gbps",
        "store_ratio",
        "retrieve_ratio",
        "lookup_128k_ms",
        "hash_tokens_per_s",
    ):
        assert field in data
    assert data["chunk_bytes"] == 2 * 32 * 16 * 1024 * 2
    assert data["bytes"] == data["chunks"] * data["chunk_bytes"] and data["chunks"] == 2
    assert data["retrieve_rel_error"] == 0.0  # lossless: the timed path's bytes, exact
    # Each ratio is the median of its phase's path/memcpy pairs, with their spread.
    assert_spread(data, "store_ratio")
    assert_spread(data, "retrieve_ratio")
    # And against a streaming copy of the same bytes in the same rounds (the CPU tier's own
    # kind of copy, the fastest on a host).
    assert data["streaming_copy_gbps"] > 0
    assert_spread(data, "store_ratio_streaming")
    assert_spread(data, "retrieve_ratio_streaming")
    assert data["pairs"] == 1 and data["load_1m"] >= 0 and data["cpus"] >= 1
    assert data["lookup_128k_ms"] > 0 and data["hash_tokens_per_s"] > 0


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    return parser.parse_args(["--chunks", "2", "--repeats", "1", "--chunk-size", "16", *argv])


def test_bench_cpu_fails_when_the_timed_retrieve_flips_a_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timed retrieve copies each chunk out of its CPU page (``_copy_out``, one batch
    per load); one byte wrong there, after the batch landed, must end the bench with an
    error, not a GB/s figure."""
    load = PlanLoader.load

    def flipping(
        self: PlanLoader,
        plan: LookupPlan,
        lease: Lease[LookupPlan],
        out: torch.Tensor | None,
        start_token: int,
        base: int = 0,
    ) -> int:
        end = load(self, plan, lease, out, start_token, base)  # a host out: landed now
        assert out is not None
        out[1, 0, start_token - base].view(torch.uint8)[1] ^= 0x10  # one byte of the chunk
        return end

    monkeypatch.setattr(PlanLoader, "load", flipping)
    with pytest.raises(AssertionError, match="retrieved bytes differ"):
        cpu.run(_args())


def test_bench_cpu_fails_when_the_timed_retrieve_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retrieve that reports every token but copies none: the destination must not hold
    the expected bytes from before (it used to be filled with them before timing)."""
    monkeypatch.setattr(PlanLoader, "_copy_out", lambda *args: None)
    with pytest.raises(AssertionError, match="retrieved bytes differ"):
        cpu.run(_args())


def test_bench_cpu_runs_the_tier_through_a_codec() -> None:
    codec = "int8"  # lossless runs the same path (test_cpu_codec_engine.py checks it)
    data = cpu.run(_args("--codec", codec))
    assert data["codec"] == codec
    assert_spread(data, "retrieve_ratio")
    assert 0 < data["retrieve_rel_error"] < 0.05


def test_bench_cpu_refuses_a_device_torch_cannot_use() -> None:
    bad = ["tpu"] if torch.cuda.is_available() else ["tpu", "cuda"]
    for device in bad:
        with pytest.raises(SystemExit, match=f"--device '{device}'"):
            cpu.run(_args("--device", device))


@pytest.mark.gpu
def test_bench_cpu_moves_kv_between_the_tier_and_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")  # the gpu marker's skip: runs only where a GPU exists
    data = cpu.run(_args("--device", "cuda"))
    assert data["device"] == "cuda" and data["retrieve_rel_error"] == 0.0
    # On a GPU each ratio is over its own direction's pinned copy.
    assert_spread(data, "store_ratio", "store_gbps", "d2h_gbps")
    assert_spread(data, "retrieve_ratio", "retrieve_gbps", "h2d_gbps")
