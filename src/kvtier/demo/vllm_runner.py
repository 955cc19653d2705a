"""``kvtier demo --engine vllm``: the chat workload on a real vLLM, with and without kvtier.

The configurations, each in its own vLLM (one child process per configuration, started with
``spawn``; vLLM starts its engine core from there)::

    no-cache   vLLM alone
    cpu        vLLM + KVTierConnector: CPU tier, writing through to a disk directory
    restart    a fresh vLLM + KVTierConnector over the same disk directory: cold CPU tier,
               warm disk tier

vLLM's own prefix cache is off in all three, so the baseline prefills every prompt from
scratch (as the transformers demo's does) and every reused token in the table is kvtier's.
Requests run one at a time in the workload's order. TTFT is vLLM's own per-request figure
(``RequestOutput.metrics.first_token_latency``: from the request's arrival to its first
token), so the decode of the answer is not counted. Every configuration must generate the
same greedy tokens; :meth:`DemoResult.mismatches` says where not.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.demo.checkpoint import write_tiny_llama
from kvtier.demo.runner import ConfigRun, DemoResult, RequestRecord
from kvtier.demo.workload import Workload, conversations, schedule
from kvtier.errors import InputError, StateError

CONNECTOR = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
CONFIG_TIMEOUT_S = 600.0  # one configuration: vLLM's start (~20 s) plus the workload


@dataclass(frozen=True, slots=True)
class VllmOptions:
    workload: Workload = field(default_factory=Workload)
    model_dir: str | None = None  # None: the tiny checkpoint of kvtier.integrations.vllm
    dtype: str = "float32"
    chunk_size: int = 256  # a multiple of vLLM's block size (16 on CPU, 128 here by default)
    disk_dir: str | None = None  # None: a temporary directory, removed afterwards
    progress: bool = True
    seed: int = 0
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: vLLM's own paged KV cache


@dataclass(frozen=True, slots=True)
class _Job:
    """What one child process runs: a configuration of the demo."""

    name: str
    label: str
    model_dir: str
    dtype: str
    workload: Workload
    connector: dict[str, Any] | None
    kv_cache_gib: int
    progress: bool
    result_path: str


def run_vllm_demo(options: VllmOptions) -> DemoResult:
    """Run the three configurations, each in a fresh vLLM, and collect what they saw."""
    notes = [
        "vLLM's own prefix cache is off in every configuration, the baseline included: reuse "
        "comes from kvtier only, and the speedups are over a vLLM that reuses nothing (with its "
        "prefix cache on, vLLM alone would reuse what still fits in its KV cache)",
        "TTFT: vLLM's RequestOutput.metrics.first_token_latency (arrival to first token)",
    ]
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-vllm-") as tmp:
        work = Path(tmp)
        if options.model_dir is not None:
            model_dir = Path(options.model_dir)
            model_name = f"local:{options.model_dir}"
        else:
            model_dir = write_tiny_llama(work / "model", seed=options.seed)
            model_name = f"kvtier-tiny-llama-seed{options.seed} (vLLM)"
        workload = replace(options.workload, vocab_size=_vocab_size(model_dir))
        disk_dir = options.disk_dir or str(work / "disk")
        tiers = _tiers(options, workload, model_dir, disk_dir)
        jobs = [
            ("no-cache", "no kvtier (vLLM prefix cache off)", None),
            ("cpu", "kvtier CPU tier (+ disk write-through)", tiers),
            ("restart", "restart: cold CPU, warm disk", tiers),
        ]
        runs: list[ConfigRun] = []
        children: list[_Child] = []
        try:
            for name, label, extra in jobs:
                if extra is not None and children and children[-1].job.connector is not None:
                    # The restart must not open the disk directory while the run before it
                    # still has it open; the baseline may shut down while the next starts.
                    children[-1].finish()
                children.append(
                    _Child(_job(name, label, extra, options, workload, model_dir, work))
                )
                runs.append(children[-1].result())
        finally:
            for child in children:
                child.finish()
    return DemoResult(workload, model_name, runs, notes)


def _job(
    name: str,
    label: str,
    extra: dict[str, Any] | None,
    options: VllmOptions,
    workload: Workload,
    model_dir: Path,
    work: Path,
) -> _Job:
    connector = None
    if extra is not None:
        connector = {
            **CONNECTOR,
            "engine_id": f"kvtier-demo-{name}-{uuid.uuid4().hex[:8]}",
            "kv_connector_extra_config": extra,
        }
    return _Job(
        name,
        label,
        str(model_dir),
        options.dtype,
        workload,
        connector,
        options.kv_cache_gib,
        options.progress,
        str(work / f"{name}.pickle"),
    )


def _vocab_size(model_dir: Path) -> int:
    try:
        config = json.loads((model_dir / "config.json").read_text())
        return int(config.get("text_config", config)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(
            f"--model-dir {str(model_dir)!r}: no readable config.json with a vocab_size ({exc})"
        ) from exc


def _tiers(
    options: VllmOptions, workload: Workload, model_dir: Path, disk_dir: str
) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[options.dtype]
    chunk_bytes = 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * width
    chunk_bytes *= options.chunk_size
    # Room for every user's whole history (plus slack), so the CPU tier never has to evict.
    chunks = workload.total_tokens() // options.chunk_size + workload.users + 8
    return {
        "chunk_size": options.chunk_size,
        "max_local_cpu_size": f"{chunks * chunk_bytes}B",
        "local_disk": disk_dir,
        "max_local_disk_size": f"{2 * chunks * chunk_bytes}B",
    }


class _Child:
    """One configuration's process. Its result is read as soon as the workload is done (the
    file is written before vLLM shuts down, which takes seconds); :meth:`finish` waits for
    the process itself."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_child_main, args=(job,), name=f"kvtier-demo-{job.name}"
        )
        self.proc.start()

    def result(self) -> ConfigRun:
        path = Path(self.job.result_path)
        deadline = time.monotonic() + CONFIG_TIMEOUT_S
        while not path.exists():
            if not self.proc.is_alive() and not path.exists():
                raise StateError(
                    f"demo configuration {self.job.name!r} failed (vLLM process exit code "
                    f"{self.proc.exitcode}); its output above says why"
                )
            if time.monotonic() > deadline:
                self.finish(0)
                raise StateError(
                    f"demo configuration {self.job.name!r} did not finish in {CONFIG_TIMEOUT_S} s"
                )
            self.proc.join(0.1)
        with path.open("rb") as f:
            run: ConfigRun = pickle.load(f)  # written by our own child process just now
        return run

    def finish(self, timeout: float = 60.0) -> None:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _child_main(job: _Job) -> None:
    """The child: one vLLM, the whole workload through it, the result pickled to a file."""
    # vLLM's engine core copies the environment when it starts: set it before.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(job.kv_cache_gib)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The engine core in this process rather than a third one: a spawned process pays
    # ~10 s of imports here. The connector still spans two processes (scheduler side here,
    # worker side in vLLM's CPU worker process), as in a server.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM reserves one more core when a KV connector is configured; on a small machine the
    # kvtier configurations would then bind their worker to different cores than the
    # baseline. The same reservation everywhere keeps the comparison fair.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    run = ConfigRun(job.name, job.label)
    llm = _start(job)
    try:
        _warm_up(llm, job.workload)
        probe = _probe(job)
        before = probe.stats() if probe is not None else None
        _workload(llm, job, run)
        if probe is not None:
            probe.flush(60.0, timeout=90.0)
            _record_cache(probe, run, before)
            probe.close()
        # Before vLLM's shutdown (seconds): the parent goes on once the file appears.
        # Written whole, then renamed, so it never reads half a file.
        partial = job.result_path + ".partial"
        with open(partial, "wb") as f:
            pickle.dump(run, f)
        os.replace(partial, job.result_path)
    finally:
        llm.llm_engine.engine_core.shutdown()  # a leftover engine can hang the exit
        del llm


def _start(job: _Job) -> Any:
    from vllm import LLM

    max_len = job.workload.max_prompt_tokens() + job.workload.answer_tokens + 16
    max_len = max(max_len, 1024)
    args: dict[str, Any] = {
        "model": job.model_dir,
        "enforce_eager": True,
        "dtype": job.dtype,
        "max_model_len": max_len,
        "max_num_batched_tokens": max_len,  # one prefill step per prompt
        "enable_prefix_caching": False,
        # The worker in its own process even with the engine core in this one (as in a
        # server): kvtier's Engine lives there, the scheduler side asks it over its socket.
        "distributed_executor_backend": "mp",
        "disable_log_stats": False,  # RequestOutput.metrics carries the TTFT
        "seed": 0,
    }
    if job.connector is not None:
        args["kv_transfer_config"] = job.connector
    return LLM(**args)


def _probe(job: _Job) -> Any:
    if job.connector is None:
        return None
    from kvtier.integrations.vllm.rpc import LookupClient

    return LookupClient(str(job.connector["engine_id"]))


def _warm_up(llm: Any, workload: Workload) -> None:
    # The first forwards pay for thread start-up and allocation; ids from their own seed
    # share no prefix with the workload.
    import random

    rng = random.Random(987654321)
    prompt = [rng.randrange(workload.vocab_size) for _ in range(workload.max_prompt_tokens())]
    _generate(llm, prompt, 2)
    _generate(llm, prompt[:64], 2)


def _generate(llm: Any, prompt: list[int], max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return out


def _workload(llm: Any, job: _Job, run: ConfigRun) -> None:
    from tqdm import tqdm

    workload = job.workload
    convs = conversations(workload)
    with tqdm(
        total=workload.requests, unit="req", desc=job.label, disable=not job.progress, leave=False
    ) as bar:
        for round_index, user in schedule(workload):
            conv = convs[user]
            prompt = conv.prompt(round_index)
            started = time.perf_counter()
            out = _generate(llm, prompt, workload.answer_tokens)
            run.wall_s += time.perf_counter() - started
            tokens = list(out.outputs[0].token_ids)
            conv.answer(round_index, tokens)
            metrics = out.metrics
            if metrics is None or metrics.first_token_latency <= 0:
                raise StateError("vLLM returned no first-token latency (are its stats off?)")
            reused = int(out.num_cached_tokens or 0)
            run.records.append(
                RequestRecord(
                    round_index,
                    user,
                    len(prompt),
                    reused,
                    reused,
                    float(metrics.first_token_latency),
                    tuple(tokens),
                )
            )
            bar.update(1)


def _record_cache(probe: Any, run: ConfigRun, before: Any) -> None:
    """Tier use at the end and hits by tier during the workload (the warm-up's taken off);
    leaked leases or broken invariants are the configuration's problems."""
    stats = probe.stats()
    run.tier_bytes = {name: int(t["used_bytes"]) for name, t in stats["tiers"].items()}
    earlier = before["hit_tokens_by_tier"] if before is not None else {}
    run.hit_tokens_by_tier = {
        tier: int(n) - int(earlier.get(tier, 0)) for tier, n in stats["hit_tokens_by_tier"].items()
    }
    # vLLM ends a request's lease from its scheduler just after the output: give it a moment.
    deadline = time.monotonic() + 5.0
    while probe.leaks() and time.monotonic() < deadline:
        time.sleep(0.05)
    run.problems = [f"leak: {info}" for info in probe.leaks()]
    run.problems += list(probe.check())
