"""Runs the chat workload under each configuration and records what every request saw.

The configurations, in order::

    no-cache   the model alone: every prompt is prefilled from scratch
    cpu        kvtier with the CPU tier (and, when the disk tier exists, writing through to it),
               run request by request alternately with no-cache so that load from other
               processes affects both alike
    restart    a new Engine after a restart: cold CPU tier, warm disk tier from the run before

Each configuration starts the conversations afresh from the same seed, so with exact reuse
every one of them must produce the same tokens; :meth:`DemoResult.mismatches` says where not.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.config import Config
from kvtier.demo.tiny_models import build_model
from kvtier.demo.workload import Workload, conversations, schedule
from kvtier.engine import Engine
from kvtier.errors import InputError
from kvtier.integrations.hf_kv import layout_from_model
from kvtier.integrations.transformers import HFConnector


def load_local_model(path: str, *, dtype: torch.dtype | None = None) -> Any:
    """A Hugging Face checkpoint from a local directory (never downloads)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot load a model from {path!r}: {exc}") from exc
    return model.eval()  # type: ignore[no-untyped-call]


def disk_tier_available() -> bool:
    return importlib.util.find_spec("kvtier.storage.disk.tier") is not None


@dataclass(frozen=True, slots=True)
class Options:
    workload: Workload = field(default_factory=Workload)
    model_size: str = "small"
    model_dir: str | None = None
    # fp32 by default: with bf16 a trained model's near-ties can flip a greedy token between
    # cached and recomputed KV (rounding, not a cache error), and the demo checks equality.
    dtype: torch.dtype = torch.float32
    chunk_size: int = 256
    disk_dir: str | None = None  # None: a temporary directory, removed afterwards
    progress: bool = True
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    round: int
    user: int
    prompt_tokens: int
    hit_tokens: int
    reused_tokens: int
    ttft_s: float
    tokens: tuple[int, ...]


@dataclass
class ConfigRun:
    name: str
    label: str
    records: list[RequestRecord] = field(default_factory=list)
    tier_bytes: dict[str, int] = field(default_factory=dict)  # used bytes per tier at the end
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0  # sum of the requests' times, prefill to last token
    problems: list[str] = field(default_factory=list)  # leaks / broken invariants afterwards

    def ttfts(self) -> list[float]:
        return [r.ttft_s for r in self.records]

    def hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.records)
        return sum(r.reused_tokens for r in self.records) / prompt if prompt else 0.0


@dataclass
class DemoResult:
    workload: Workload
    model: str
    configs: list[ConfigRun]
    notes: list[str]

    def problems(self) -> list[str]:
        """Leaked leases or broken reference counts once a configuration finished."""
        return [f"{run.name}: {p}" for run in self.configs for p in run.problems]

    def mismatches(self) -> list[str]:
        """Requests whose tokens differ from the no-cache run (empty = all identical)."""
        base = {(r.round, r.user): r.tokens for r in self.configs[0].records}
        problems = []
        for run in self.configs[1:]:
            for rec in run.records:
                if base.get((rec.round, rec.user)) != rec.tokens:
                    problems.append(f"{run.name}: round {rec.round + 1}, user {rec.user + 1}")
        return problems


def run_demo(options: Options, *, on_engine: Callable[[Engine], None] | None = None) -> DemoResult:
    """Run every configuration; ``on_engine`` is called with each engine once it is open
    (the CLI uses it to attach the admin dashboard)."""
    model, model_name = _model(options)
    workload = _fit_vocab(options.workload, model)
    notes: list[str] = []
    _warm_up(model, workload)
    total = workload.requests * (3 if disk_tier_available() else 2)
    from tqdm import tqdm  # the [demo] extra: imported where the progress bar is drawn

    bar = tqdm(total=total, unit="req", disable=not options.progress, leave=False)
    baseline = ConfigRun("no-cache", "no kvtier")
    runs = [baseline]
    try:
        with _disk_dir(options) as disk_dir:
            config = _config(options, workload, model, disk_dir)
            if disk_dir is None:
                notes.append(
                    "disk tier not available in this build (kvtier.storage.disk.tier missing): "
                    "the restart configuration was skipped"
                )
            label = "kvtier CPU tier" + (" (+ disk write-through)" if disk_dir else "")
            with Engine(config, layout_from_model(model), model_name=model_name) as engine:
                if on_engine is not None:
                    on_engine(engine)
                cpu = ConfigRun("cpu", label)
                runs.append(cpu)
                # Request by request, baseline then kvtier: a noisy neighbour slows both alike.
                pairs = [
                    (baseline, HFConnector(None, model)),
                    (cpu, HFConnector(engine, model)),
                ]
                _run(pairs, workload, bar)
            if disk_dir is not None:
                # A restart: a new Engine (empty CPU tier) over the disk tier's directory.
                with Engine(config, layout_from_model(model), model_name=model_name) as engine:
                    if on_engine is not None:
                        on_engine(engine)
                    restart = ConfigRun("restart", "restart: cold CPU, warm disk")
                    runs.append(restart)
                    _run([(restart, HFConnector(engine, model))], workload, bar)
    finally:
        bar.close()
    return DemoResult(workload, model_name, runs, notes)


def _run(pairs: list[tuple[ConfigRun, HFConnector]], workload: Workload, bar: Any) -> None:
    """Every request of the workload through each connector in turn (each its own history)."""
    bar.set_description(" / ".join(run.label for run, _ in pairs))
    convs = [conversations(workload) for _ in pairs]
    for round_index, user in schedule(workload):
        for (run, conn), conv_set in zip(pairs, convs, strict=True):
            conv = conv_set[user]
            prompt = conv.prompt(round_index)
            gen = conn.generate(prompt, workload.answer_tokens, use_cache=conn.engine is not None)
            conv.answer(round_index, gen.tokens)
            run.wall_s += gen.total_s
            run.records.append(
                RequestRecord(
                    round_index,
                    user,
                    len(prompt),
                    gen.hit_tokens,
                    gen.reused_tokens,
                    gen.ttft_s,
                    tuple(gen.tokens),
                )
            )
            bar.update(1)
    for run, conn in pairs:
        if conn.engine is not None:
            conn.engine.flush(60)
            run.problems = [f"leak: {info}" for info in conn.engine.leaks()]
            run.problems += conn.engine.check_invariants()
            stats = conn.engine.stats()
            run.tier_bytes = {name: t["used_bytes"] for name, t in stats["tiers"].items()}
            run.hit_tokens_by_tier = dict(stats["hit_tokens_by_tier"])


def _model(options: Options) -> tuple[Any, str]:
    if options.model_dir:
        model = load_local_model(options.model_dir, dtype=options.dtype)
        return model, f"local:{options.model_dir}"
    model = build_model("llama", options.model_size, dtype=options.dtype, seed=options.seed)
    return model, f"kvtier-demo-llama-{options.model_size}-seed{options.seed}"


def _fit_vocab(workload: Workload, model: Any) -> Workload:
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    if workload.vocab_size == vocab:
        return workload
    from dataclasses import replace

    return replace(workload, vocab_size=vocab)


def _warm_up(model: Any, workload: Workload) -> None:
    # The first forward passes pay for kernel selection and thread start-up (~0.5 s here);
    # without this the first configuration's first request would look slow for no reason.
    conn = HFConnector(None, model)
    gen = torch.Generator().manual_seed(12345)
    for n in (64, workload.max_prompt_tokens()):
        conn.generate(torch.randint(0, workload.vocab_size, (n,), generator=gen), 2)


def _config(options: Options, workload: Workload, model: Any, disk_dir: str | None) -> Config:
    layout = layout_from_model(model)
    chunk_bytes = layout.chunk_bytes(options.chunk_size)
    # Room for every user's whole history (plus slack), so the CPU tier never has to evict.
    chunks = workload.total_tokens() // options.chunk_size + workload.users + 8
    values: dict[str, object] = {
        "chunk_size": options.chunk_size,
        "max_local_cpu_size": f"{chunks * chunk_bytes}B",
    }
    if disk_dir is not None:
        values["local_disk"] = disk_dir
        values["max_local_disk_size"] = f"{2 * chunks * chunk_bytes}B"
    return Config.load(overrides=values, env={})


@contextmanager
def _disk_dir(options: Options) -> Iterator[str | None]:
    if not disk_tier_available():
        yield None
    elif options.disk_dir is not None:
        yield options.disk_dir
    else:
        path = tempfile.mkdtemp(prefix="kvtier-demo-")
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
