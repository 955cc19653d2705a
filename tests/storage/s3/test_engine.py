"""Engines on the s3 tier: a restart of every engine finds the fleet's KV (a new process,
fresh state, credentials and endpoint from the AWS environment as in production), and a
long prompt's lookup sends no request."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier import Engine
from kvtier.bench.seaweedfs import SeaweedFS
from kvtier.storage.s3.tier import S3Tier
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config

PROMPT_TOKENS = 80  # 5 chunks of 16


def _engine(bucket: str, **overrides: object) -> Engine:
    """An engine whose s3 tier reads AWS_* from the environment (no keys in its config)."""
    config = small_config(remote_url=f"s3://{bucket}/fleet", **overrides)
    return Engine(config, SMALL_LAYOUT, model_name="m").open()


def _store_in_child(env: dict[str, str], bucket: str, out_path: str) -> None:
    """Runs in a spawned process: store a prompt, flush, close, report."""
    os.environ.update(env)
    with _engine(bucket) as engine:
        stored = engine.store(make_tokens(PROMPT_TOKENS, seed=5), make_kv(PROMPT_TOKENS, seed=5))
        flushed = engine.flush(20.0)
    Path(out_path).write_text(f"{stored} {flushed}")


def _load_in_child(env: dict[str, str], bucket: str, out_path: str) -> None:
    """Runs in another spawned process, after the first closed: look up and load."""
    os.environ.update(env)
    tokens = make_tokens(PROMPT_TOKENS, seed=5)
    with _engine(bucket) as engine, engine.request("r"):
        hit = engine.lookup(tokens, "r")
        kv = engine.retrieve(tokens, "r")
        same = kv.numpy().tobytes() == make_kv(PROMPT_TOKENS, seed=5).numpy().tobytes()
        Path(out_path).write_text(f"{hit.tokens} {same}")


def _run(target: Callable[..., None], args: tuple[object, ...]) -> None:
    child = multiprocessing.get_context("spawn").Process(target=target, args=args)
    child.start()
    child.join(180)
    assert child.exitcode == 0, f"{target.__name__} exited {child.exitcode}"


def test_a_restart_of_every_engine_finds_the_kv(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path
) -> None:
    env = seaweedfs.environment()
    stored, loaded = tmp_path / "stored.txt", tmp_path / "loaded.txt"
    _run(_store_in_child, (env, bucket, str(stored)))
    assert stored.read_text() == "5 True"
    _run(_load_in_child, (env, bucket, str(loaded)))  # nothing of the writer is left
    assert loaded.read_text() == f"{PROMPT_TOKENS} True"


def test_a_long_lookup_sends_no_request(
    seaweedfs: SeaweedFS, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of 512 chunks stored, then looked up by a fresh engine with the server
    stopped (SIGSTOP): the hit is whole and answered at once, from the index."""
    for name, value in seaweedfs.environment().items():
        monkeypatch.setenv(name, value)
    tokens = make_tokens(512 * 16, seed=9)
    with _engine(bucket, cpu_chunks=600) as writer:
        assert writer.store(tokens, make_kv(len(tokens), seed=9)) == 512
        assert writer.flush(60.0)
    with _engine(bucket, local_cpu=False, cpu_chunks=600) as reader:
        tier = reader.tier("s3")
        assert isinstance(tier, S3Tier)
        seaweedfs.pause()
        try:
            start = time.monotonic()
            with reader.request("r"):
                hit = reader.lookup(tokens, "r")
            took = time.monotonic() - start
        finally:
            seaweedfs.resume()
        assert hit.tokens == len(tokens)
        assert took < 1.0, f"lookup took {took:.2f}s with the server stopped"
        assert tier.counters.listings == 1
