"""``kvtier bench vllm``: time to first token inside a real vLLM, with and without kvtier.

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
        kvtier_disk   the prompts again: kvtier's disk tier serves        ttft_kvtier_disk_ms
    instance 3: vLLM's ExampleConnector (safetensors files per layer)
        example       stored once, prefix cache reset, asked again        ttft_example_ms

    efficiency_cpu  = (cold - kvtier_cpu) / (cold - apc)    1.0: as good as vLLM's own cache
    efficiency_disk = (cold - kvtier_disk) / (cold - apc)
    speedup_vs_example = example / kvtier_cpu

Every prefix hit still recomputes the prompt's last block (vLLM needs the last token's
logits), in all the cached variants alike.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.integrations.vllm.checkpoint import write_tiny_llama

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
    with _stdout_to_stderr(), _work_dir(args.work_dir) as work:
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
                apc.append(ttft(prompt))
                llm.reset_prefix_cache()
                cpu.append(ttft(prompt))
            times.update(cold=min(cold), apc=min(apc), kvtier_cpu=min(cpu))
            _flush(llm)

        with _llm(
            model, args.prompt_tokens, {**CONNECTOR, "kv_connector_extra_config": tiers}
        ) as llm:
            ttft = _ttft(llm)
            ttft(prompts[0])
            times["kvtier_disk"] = min(ttft(p) for p in prompts[1:])

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
                llm.reset_prefix_cache()
                best = min(best, ttft(prompt))
            times["example"] = best

    saved_ideal = times["cold"] - times["apc"]
    return {
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        **{f"ttft_{k}_ms": round(v * 1000, 2) for k, v in times.items()},
        "efficiency_cpu": round((times["cold"] - times["kvtier_cpu"]) / saved_ideal, 3),
        "efficiency_disk": round((times["cold"] - times["kvtier_disk"]) / saved_ideal, 3),
        "speedup_vs_example": round(times["example"] / times["kvtier_cpu"], 2),
    }


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
        client.call("flush", 60.0, timeout=90.0)
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


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """vLLM logs to stdout, in this process and in the ones it starts: point file descriptor
    1 at stderr while it runs, so ``--json`` prints one clean JSON object."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextmanager
def _work_dir(path: str | None) -> Iterator[Path]:
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        yield Path(tmp)
