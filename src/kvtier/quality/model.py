"""The model the gate measures with: a tiny Llama trained in-process on the recall task.

Random weights say nothing about quality (their answers mean nothing, so nothing can be
lost), so the gate trains a model that really recalls, once per machine, and caches it::

    RecallModelSpec ──hash──> <cache dir>/recall-<sha256[:16]>.pt
       (task, model size, schedule, seed)     present: loaded;  absent: trained, then saved

Training (measured on a shared 2-core x86-64 box with one torch thread: 100 to 150 s):

    phase 1   ``short_steps``  batches of a 64-token context, 64 queries each  (the
              attention learns to find the fact: cheap, short sequences)
    phase 2   ``long_steps``   batches of the gate's own context length         (it learns
              to find it among ``context`` tokens: trained at 64, it reaches ~86% at 256)

AdamW with a one-cycle learning rate; every draw comes from generators seeded by ``seed``,
so a machine trains the same weights every time. A model below ``min_accuracy`` with
recomputed KV is refused (:class:`TrainingFailed`), never cached: a gate on a model that
cannot recall would pass every codec.

A cached file is never taken at its word: loading it measures its accuracy again, as after
training (one batch of 256 sequences: seconds), and a file that cannot be read or no longer
recalls to ``min_accuracy`` (stale, damaged or replaced: a model that ignores its context
passes every codec, a zeroing one too) is trained again and replaced. The accuracy written in
the file is not read at all.

The cache directory is ``$KVTIER_QUALITY_CACHE``, else ``$XDG_CACHE_HOME/kvtier/quality``,
else ``~/.cache/kvtier/quality``. One process trains a spec at a time (a lock beside its
file: the others wait, then load it), and the file is written under a temporary name and
renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pickle
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import KVTierError
from kvtier.quality.task import RecallTask

log = logging.getLogger(__name__)


class TrainingFailed(KVTierError):
    """The recall model did not reach the accuracy the gate needs to mean anything."""


@dataclass(frozen=True, slots=True)
class RecallModelSpec:
    """Everything that decides the trained weights (and so names the cache file)."""

    task: RecallTask = field(default_factory=RecallTask)
    layers: int = 2
    hidden: int = 64
    heads: int = 2
    short_context: int = 64
    short_queries: int = 64
    short_steps: int = 350
    long_steps: int = 250
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0
    min_accuracy: float = 0.93

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.task.vocab_size,
            hidden_size=self.hidden,
            intermediate_size=2 * self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=4 * (self.task.prefix_tokens + 2 * self.task.queries),
            tie_word_embeddings=False,
        )


@dataclass(frozen=True, slots=True)
class RecallModel:
    """A trained recall model (fp32, eval mode) and how it came to be."""

    model: Any  # transformers LlamaForCausalLM
    spec: RecallModelSpec
    path: Path
    train_s: float  # 0.0 when loaded from the cache
    accuracy: float  # on fresh sequences with recomputed KV, measured after training or load

    @property
    def name(self) -> str:
        return f"recall-{self.spec.digest()}"


def cache_dir() -> Path:
    explicit = os.environ.get("KVTIER_QUALITY_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "quality"


def recall_model(
    spec: RecallModelSpec | None = None, *, directory: Path | None = None
) -> RecallModel:
    """The trained model of ``spec``: loaded from the cache, or trained (minutes) and cached."""
    spec = spec or RecallModelSpec()
    path = (directory or cache_dir()) / f"recall-{spec.digest()}.pt"
    # One trainer per cache file: another process asking meanwhile (a second benchmark, a
    # parallel test worker) waits for the first and loads what it wrote instead of training.
    with _training_lock(path):
        return _load_or_train(spec, path)


@contextlib.contextmanager
def _training_lock(path: Path) -> Iterator[None]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield  # an unwritable cache: training is not cached either, so nothing to share
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load_or_train(spec: RecallModelSpec, path: Path) -> RecallModel:
    if path.exists():
        loaded = _load_verified(spec, path)
        if loaded is not None:
            return loaded
    model = _build(spec)
    start = time.perf_counter()
    _train(model, spec)
    train_s = time.perf_counter() - start
    model.eval()
    accuracy = _accuracy(model, spec)
    if accuracy < spec.min_accuracy:
        raise TrainingFailed(
            f"the recall model reached {accuracy:.1%} with recomputed KV after "
            f"{spec.short_steps + spec.long_steps} steps, below the {spec.min_accuracy:.0%} "
            "the quality gate needs; train longer (RecallModelSpec.long_steps)"
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    torch.save({"weights": model.state_dict(), "accuracy": accuracy}, tmp)
    os.replace(tmp, path)
    return RecallModel(model, spec, path, train_s, accuracy)


def _load_verified(spec: RecallModelSpec, path: Path) -> RecallModel | None:
    """The model cached at ``path`` if it still recalls to ``spec.min_accuracy``, else None
    (said in a WARNING; the caller trains again and replaces the file)."""
    model = _build(spec)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["weights"])
    # What a damaged or foreign file raises: an unreadable or truncated archive, a pickle
    # weights_only refuses, no "weights" in it, tensors of another shape.
    except (OSError, EOFError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError) as exc:
        log.warning("recall model %s cannot be read (%s): training it again", path, exc)
        return None
    model.eval()
    accuracy = _accuracy(model, spec)
    if accuracy < spec.min_accuracy:
        log.warning(
            "recall model %s answers %.1f%% with recomputed KV, below the %.0f%% the quality "
            "gate needs (a stale, damaged or replaced file): training it again",
            path,
            100 * accuracy,
            100 * spec.min_accuracy,
        )
        return None
    return RecallModel(model, spec, path, 0.0, accuracy)


def _accuracy(model: Any, spec: RecallModelSpec) -> float:
    """The accuracy a model of ``spec`` must reach: after training, and again at every load."""
    return answer_accuracy(model, spec.task, torch.Generator().manual_seed(spec.seed + 1))


def answer_accuracy(
    model: Any, task: RecallTask, generator: torch.Generator, sequences: int = 256
) -> float:
    """Share of queries answered right with the whole sequence computed in one pass."""
    batch = task.sample(generator, sequences)
    with torch.inference_mode():
        logits = model(input_ids=batch.tokens).logits[:, task.prefix_tokens :]
    picked = logits[:, batch.answer_slots].argmax(-1)
    return float((picked == batch.answers).float().mean())


def _build(spec: RecallModelSpec) -> Any:
    from transformers import LlamaForCausalLM

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        return LlamaForCausalLM(spec.config())  # type: ignore[no-untyped-call]
    finally:
        torch.random.set_rng_state(state)


def _train(model: Any, spec: RecallModelSpec) -> None:
    short = RecallTask(
        keys=spec.task.keys,
        values=spec.task.values,
        fillers=spec.task.fillers,
        context=spec.short_context,
        queries=spec.short_queries,
    )
    steps = spec.short_steps + spec.long_steps
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, weight_decay=0.0, betas=(0.9, 0.98)
    )
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=spec.lr, total_steps=steps, pct_start=0.1
    )
    generator = torch.Generator().manual_seed(spec.seed)
    model.train()
    for step in range(steps):
        task = short if step < spec.short_steps else spec.task
        batch = task.sample(generator, spec.batch)
        logits = model(input_ids=batch.tokens).logits[:, task.prefix_tokens :]
        logits = logits[:, batch.answer_slots]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch.answers.reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        schedule.step()
