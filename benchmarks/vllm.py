"""``python -m benchmarks vllm``: time to first token inside a real vLLM, with and without kvtier.

One tiny Llama checkpoint written by code (4 layers, hidden 256, 2 KV heads), float32,
``enforce_eager``, a prompt of ``--prompt-tokens`` (4096) random tokens, ``max_tokens=1``: the
wall time of one request is its time to first token. Each repeat uses a new prompt; the best
of the repeats is reported (the least disturbed by other work on a shared machine). After
each cold run the disk writes it started are waited for, so they do not share the 2 cores
with the next measurement::

    instance 1: kvtier (CPU tier + a disk directory)
        cold          nothing cached anywhere                             ttft_cold_ms
        apc           the same prompt again: vLLM's own prefix cache      ttft_apc_ms
        kvtier_cpu    vLLM's prefix cache reset, kvtier's CPU tier serves ttft_kvtier_cpu_ms
    instance 2: a fresh vLLM + kvtier on the same disk directory
        kvtier_disk   the prompts again: kvtier's disk tier serves,       ttft_kvtier_disk_ms
                      its files still in the page cache (warm)
        kvtier_disk_cold  other prompts stored by instance 1, their files ttft_kvtier_disk_cold_ms
                      dropped from the page cache before each request
    instance 3: vLLM's ExampleConnector (safetensors files per layer)
        example       stored once, prefix cache reset, asked again        ttft_example_ms

    efficiency_cpu  = (cold - kvtier_cpu) / (cold - apc)    1.0: as good as vLLM's own cache
    efficiency_disk = (cold - kvtier_disk) / (cold - apc)          (and _disk_cold)
    speedup_vs_example = example / kvtier_cpu

Every prefix hit still recomputes the prompt's last block (vLLM needs the last token's
logits), in all the cached variants alike.

Each figure is checked to be what it says: ``reset_prefix_cache()`` must succeed before a
kvtier_cpu run, and the worker Engine's counters (read over its channel around each request)
must show kvtier served every whole chunk but the last token's (``kvtier_served_tokens``),
from the CPU tier for kvtier_cpu and from the disk tier for the disk runs, and nothing for
apc; otherwise the bench fails instead of printing a figure that measured something else.
"""

from __future__ import annotations

import argparse
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.isolation import stdout_to_stderr, work_dir
from kvtier.demo.checkpoint import write_tiny_llama

DISK_PAGE_CACHE = (
    "ttft_kvtier_disk_ms: the disk tier's files were written minutes before and are in the "
    "page cache (warm); ttft_kvtier_disk_cold_ms: each file dropped from the page cache "
    "(posix_fadvise DONTNEED) before the request"
)
CONNECTOR = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work-dir", default=None, help="checkpoint and disk tier (temp dir)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with stdout_to_stderr(), work_dir(args.work_dir, "kvtier-bench-vllm-") as work:
        model = write_tiny_llama(work / "model")
        rng = random.Random(7)
        prompts = [
            [rng.randrange(3, 1024) for _ in range(args.prompt_tokens)]
            for _ in range(args.repeats + 1)  # the first one warms each instance up
        ]
        disk = work / "disk"
        tiers = {
            "max_local_cpu_size": "1GiB",
            "local_disk": str(disk),
            "max_local_disk_size": "4GiB",
        }
        times: dict[str, float] = {}
        served: dict[str, int] = {}
        # Stored in instance 1 but first asked in instance 2 with their files dropped from
        # the page cache: the cold-disk figure.
        cold_prompts = [
            [rng.randrange(3, 1024) for _ in range(args.prompt_tokens)] for _ in range(args.repeats)
        ]
        expected = _expected_hit(args.prompt_tokens)

        with _llm(
            model, args.prompt_tokens, {**CONNECTOR, "kv_connector_extra_config": tiers}
        ) as llm:
            ttft = _ttft(llm)
            ttft(prompts[0])
            cold, apc, cpu = [], [], []
            for prompt in prompts[1:]:
                cold.append(ttft(prompt))
                # The cold run's disk writes go on in the background; on a 2-core machine
                # they would slow whatever is measured next.
                _flush(llm)
                with _served(llm, "apc", (0, 0)):
                    apc.append(ttft(prompt))
                _reset_prefix_cache(llm)
                with _served(llm, "kvtier_cpu", expected, tier="cpu") as counts:
                    cpu.append(ttft(prompt))
                served["kvtier_cpu"] = counts["retrieved_tokens"]
            for prompt in cold_prompts:
                ttft(prompt)  # stored on disk for instance 2
            times.update(cold=min(cold), apc=min(apc), kvtier_cpu=min(cpu))
            _flush(llm)

        with _llm(
            model, args.prompt_tokens, {**CONNECTOR, "kv_connector_extra_config": tiers}
        ) as llm:
            ttft = _ttft(llm)
            ttft(prompts[0])
            warm = []
            for prompt in prompts[1:]:
                with _served(llm, "kvtier_disk", expected, tier="disk") as counts:
                    warm.append(ttft(prompt))
            served["kvtier_disk"] = counts["retrieved_tokens"]
            times["kvtier_disk"] = min(warm)
            cold_disk = []
            for prompt in cold_prompts:
                _drop_page_cache(disk)
                with _served(llm, "kvtier_disk_cold", expected, tier="disk") as counts:
                    cold_disk.append(ttft(prompt))
            times["kvtier_disk_cold"] = min(cold_disk)
            served["kvtier_disk_cold"] = counts["retrieved_tokens"]

        example = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(work / "example")},
        }
        with _llm(model, args.prompt_tokens, example) as llm:
            ttft = _ttft(llm)
            ttft(prompts[0])
            best = float("inf")
            for prompt in prompts[1:]:
                ttft(prompt)  # stores it
                _reset_prefix_cache(llm)
                best = min(best, ttft(prompt))
            times["example"] = best

    saved_ideal = times["cold"] - times["apc"]
    return {
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        **{f"ttft_{k}_ms": round(v * 1000, 2) for k, v in times.items()},
        "efficiency_cpu": round((times["cold"] - times["kvtier_cpu"]) / saved_ideal, 3),
        "efficiency_disk": round((times["cold"] - times["kvtier_disk"]) / saved_ideal, 3),
        "efficiency_disk_cold": round((times["cold"] - times["kvtier_disk_cold"]) / saved_ideal, 3),
        "speedup_vs_example": round(times["example"] / times["kvtier_cpu"], 2),
        "kvtier_served_tokens": served,  # per kvtier run, each checked against the hit
        "disk_page_cache": DISK_PAGE_CACHE,
    }


def _expected_hit(prompt_tokens: int) -> tuple[int, int]:
    """Tokens kvtier serves for a fully cached prompt, as a range: whole chunks only; the chunk
    holding the last token (vLLM computes that token for its logits) is loaded whole when it
    is a whole chunk, and not at all when vLLM's blocks end before it."""
    from kvtier.config import Config

    chunk = Config.load(env={}).chunk_size
    return (prompt_tokens - 1) // chunk * chunk, prompt_tokens // chunk * chunk


def _reset_prefix_cache(llm: Any) -> None:
    if not llm.reset_prefix_cache():
        raise AssertionError(
            "bench vllm: vLLM refused to reset its prefix cache, so the next run would "
            "measure vLLM's own cache, not kvtier"
        )


@contextmanager
def _served(
    llm: Any, run: str, expected: tuple[int, int], tier: str | None = None
) -> Iterator[dict[str, int]]:
    """Check that the request run inside got between ``expected[0]`` and ``expected[1]``
    tokens from kvtier (the worker Engine's ``retrieved_tokens`` counter, read over its
    channel before and after), all from ``tier``'s hits when given. Yields the counts, filled
    in on exit; a run kvtier did not serve as claimed raises :class:`AssertionError`: its
    figure would be another one's."""
    low, high = expected
    wanted = f"{low}" if low == high else f"{low} to {high}"
    counts: dict[str, int] = {}
    before = _stats(llm)
    yield counts
    after = _stats(llm)
    got = counts["retrieved_tokens"] = after["retrieved_tokens"] - before["retrieved_tokens"]
    if not low <= got <= high:
        raise AssertionError(f"bench vllm {run}: kvtier served {got} tokens, expected {wanted}")
    if tier is not None:
        by_tier = after["hit_tokens_by_tier"]
        from_tier = by_tier.get(tier, 0) - before["hit_tokens_by_tier"].get(tier, 0)
        if from_tier != got:
            raise AssertionError(
                f"bench vllm {run}: the {tier} tier served {from_tier} of the {got} tokens"
            )


def _stats(llm: Any) -> dict[str, Any]:
    """The worker Engine's stats, over its channel."""
    from kvtier.integrations.vllm.rpc import LookupClient

    client = LookupClient(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
    try:
        stats: dict[str, Any] = client.stats()
        return stats
    finally:
        client.close()


def _drop_page_cache(directory: Path) -> None:
    """Evict the disk tier's files from the page cache (``posix_fadvise`` DONTNEED on each:
    clean pages of unmapped files go, without root and without touching other files)."""
    for path in directory.rglob("*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError):
            continue  # a temporary file renamed meanwhile, or a directory
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ttft(llm: Any) -> Callable[[list[int]], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)

    def once(prompt: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - start

    return once


def _flush(llm: Any) -> None:
    """Wait until the disk tier holds everything (the worker's Engine, over its channel)."""
    from kvtier.integrations.vllm.rpc import LookupClient

    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    client = LookupClient(engine_id)
    try:
        client.flush(60.0, timeout=90.0)
    finally:
        client.close()


@contextmanager
def _llm(model: Path, prompt_tokens: int, transfer: dict[str, Any]) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(
        model=str(model),
        enforce_eager=True,
        dtype="float32",
        max_model_len=prompt_tokens + 256,
        max_num_batched_tokens=prompt_tokens + 256,  # one prefill step for the whole prompt
        seed=0,
        kv_transfer_config={**transfer, "engine_id": f"kvtier-bench-{uuid.uuid4().hex[:8]}"},
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()  # a leftover engine can hang the exit
        del llm
