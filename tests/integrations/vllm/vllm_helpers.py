"""Real vLLM instances for the connector tests, one at a time.

Each :class:`VllmInstance` is an ``LLM`` (engine-core and worker processes, spawned) with the
tiny checkpoint, ``enforce_eager`` and float32; ``probe`` reaches the worker's Engine over the
connector's own lookup channel (stats, leaks, check_invariants, flush). :class:`Instances`
keeps at most one running and shuts it down explicitly (a leftover LLM can hang the
interpreter at exit).
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.integrations.vllm.rpc import LookupClient
from tests.server.server_helpers import ServerProcess, remove_tempdir, short_tempdir

CONNECTOR = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
MAX_TOKENS = 8
SHUTDOWN_WAIT_S = 1.0


def unique_engine_id(name: str) -> str:
    """An engine id no other test run on this machine uses: the lookup channel's socket is
    named after it, and two test runs at once must not answer each other's lookups."""
    return f"{name}-{os.getpid()}"


@contextmanager
def _env(values: dict[str, str | None]) -> Iterator[None]:
    """vLLM's children copy the environment when they start: set it around the start."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VllmInstance:
    def __init__(
        self,
        model_dir: Path,
        *,
        engine_id: str | None,
        extra: dict[str, Any] | None = None,
        transfer: dict[str, Any] | None = None,
        kv_cache_bytes: int | None = None,
        **llm_args: Any,
    ) -> None:
        from vllm import LLM

        args: dict[str, Any] = {
            "model": str(model_dir),
            "enforce_eager": True,
            "dtype": "float32",
            "max_model_len": 4096,
            "seed": 0,
            **llm_args,
        }
        if engine_id is not None:
            extra = {"chunk_size": 256, **(extra or {})}
            if extra["chunk_size"] is None:  # left to the connector, as a user who sets none
                del extra["chunk_size"]
            args["kv_transfer_config"] = {
                **CONNECTOR,
                **(transfer or {}),
                "engine_id": engine_id,
                # The tests were written at 256-token chunks; chunk_size None leaves it to
                # the connector, which takes one from vLLM's blocks (test_groups.py).
                "kv_connector_extra_config": extra,
            }
        # VLLM_CPU_KVCACHE_SPACE (GiB) overrides kv_cache_memory_bytes on the CPU build.
        env: dict[str, str | None] = {"VLLM_CPU_KVCACHE_SPACE": "1"}
        if kv_cache_bytes is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = None
            args["kv_cache_memory_bytes"] = kv_cache_bytes
        with _env(env):
            self.llm = LLM(**args)
        self.probe = LookupClient(engine_id) if engine_id is not None else None

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = MAX_TOKENS
    ) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def stats(self) -> dict[str, Any]:
        assert self.probe is not None
        return dict(self.probe.stats())

    def assert_clean(self, wait_s: float = 0.0) -> None:
        """No request holds anything and every reference has an owner. ``wait_s``: an abort
        is asynchronous (the client does not wait for the engine core), so give it time."""
        assert self.probe is not None
        deadline = time.monotonic() + wait_s
        while self.probe.leaks() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.probe.leaks() == []
        assert self.probe.check() == []
        stats = self.stats()
        assert stats["open_requests"] == 0 and stats["pinned_pages"] == 0

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        # vLLM waits 5 s for its engine core, whose CPU worker takes that long or longer to
        # leave after its queues close (then both are killed): every close paid 5 s. Nothing
        # of kvtier's is lost by a shorter wait: the tests flush kvtier's writes before they
        # restart (probe.flush), and a killed worker is a crash kvtier must survive anyway.
        self.llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_WAIT_S)
        del self.llm
        gc.collect()


class Instances:
    """At most one running vLLM; ``get(name, factory)`` reuses it while the name matches."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.instance: VllmInstance | None = None

    def get(self, name: str, factory: Callable[[], VllmInstance]) -> VllmInstance:
        if self.name != name:
            self.close()
            self.instance = factory()
            self.name = name
        assert self.instance is not None
        return self.instance

    def close(self) -> None:
        if self.instance is not None:
            self.instance.close()
        self.instance, self.name = None, None


def tokens(n: int, seed: int) -> list[int]:
    """``n`` ids the tiny tokenizer has words for (3..1023), reproducibly."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


@contextmanager
def reader_through_server(
    holder: Instances, model_dir: Path, disk: Path, *, dtype: str, **llm_args: Any
) -> Iterator[VllmInstance]:
    """A restart: a ``kvtier server`` opens ``disk`` (what an earlier vLLM with kvtier wrote
    there) and a fresh vLLM with kvtier (its own ``chunk_size``) reads through it. The
    vLLM is closed and the server's log checked for tracebacks on the way out."""
    where = short_tempdir()
    server = ServerProcess(
        where, max_local_cpu_size="256MiB", local_disk=str(disk), max_local_disk_size="1GiB"
    ).start()
    try:
        yield holder.get(
            "server",
            lambda: VllmInstance(
                model_dir,
                engine_id=unique_engine_id("kvtier-server-reader"),
                extra={"chunk_size": None, "server": server.url},
                dtype=dtype,
                **llm_args,
            ),
        )
        holder.close()
        assert "Traceback" not in server.log(), server.log()
    finally:
        server.stop()
        remove_tempdir(where)
