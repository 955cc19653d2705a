"""``python -m benchmarks vllm``'s checks that kvtier served the runs it names, against a real
Engine over its real lookup socket (the worker side without vLLM's processes; the LLM handle
the bench reads its engine id from is the only stand-in). The bench itself runs three vLLM
instances, too slow for the suite; ``python -m benchmarks vllm --json`` exercises these checks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmarks.vllm import _drop_page_cache, _reset_prefix_cache, _served

from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm.worker_helpers import fill, make_worker

TOKENS = list(range(300, 370))  # 70 tokens: two whole 32-token chunks


@pytest.fixture
def worker() -> Iterator[WorkerSide]:
    side = make_worker()
    fill(side, [1, 2, 3, 4], seed=3)
    side.save(KVTierMetadata(saves=[SaveSpec("s", TOKENS[:64], [1, 2, 3, 4], 0, 64)]))
    yield side
    side.close()


def handle(worker: WorkerSide, reset: bool = True) -> SimpleNamespace:
    """What the bench reads from ``vllm.LLM``: the engine id, and reset_prefix_cache."""
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=worker.engine_id))
    return SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=config), reset_prefix_cache=lambda: reset
    )


def serve(worker: WorkerSide, rid: str) -> None:
    """What vLLM does for a request kvtier serves: lookup, load into its blocks, end."""
    client = LookupClient(worker.engine_id)
    try:
        assert client.lookup(rid, TOKENS).tokens == 64
        worker.load(KVTierMetadata(loads=[LoadSpec(rid, TOKENS, [9, 10, 11, 12, 13], 0, 64)]))
        client.end(rid)
    finally:
        client.close()


def test_a_run_kvtier_served_passes_and_reports_its_tokens(worker: WorkerSide) -> None:
    with _served(handle(worker), "kvtier_cpu", (64, 64), tier="cpu") as counts:
        serve(worker, "a")
    assert counts == {"retrieved_tokens": 64}


def test_a_run_kvtier_did_not_serve_fails_instead_of_giving_a_figure(
    worker: WorkerSide,
) -> None:
    # vLLM's own prefix cache answered (no reset): kvtier retrieved nothing.
    with (
        pytest.raises(
            AssertionError, match="kvtier_cpu: kvtier served 0 tokens, expected 32 to 64"
        ),
        _served(handle(worker), "kvtier_cpu", (32, 64), tier="cpu"),
    ):
        pass


def test_a_run_served_by_another_tier_fails(worker: WorkerSide) -> None:
    with (
        pytest.raises(AssertionError, match="the disk tier served 0 of the 64 tokens"),
        _served(handle(worker), "kvtier_disk", (64, 64), tier="disk"),
    ):
        serve(worker, "b")


def test_a_run_meant_for_vllms_own_cache_fails_when_kvtier_served(worker: WorkerSide) -> None:
    with (
        pytest.raises(AssertionError, match="apc: kvtier served 64 tokens, expected 0"),
        _served(handle(worker), "apc", (0, 0)),
    ):
        serve(worker, "c")


def test_a_refused_prefix_cache_reset_fails(worker: WorkerSide) -> None:
    _reset_prefix_cache(handle(worker, reset=True))
    with pytest.raises(AssertionError, match="refused to reset its prefix cache"):
        _reset_prefix_cache(handle(worker, reset=False))


def test_page_cache_drop_runs_over_the_disk_directory(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.kvc").write_bytes(b"x" * 8192)
    (tmp_path / "b.kvc").write_bytes(b"y" * 100)
    _drop_page_cache(tmp_path)  # no error; the files are still there, unchanged
    assert (tmp_path / "sub" / "a.kvc").read_bytes() == b"x" * 8192
