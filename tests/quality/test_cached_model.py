"""The gate never trusts the accuracy a cached model file claims: a file whose weights do not
recall (stale, damaged, replaced) is trained again, and a gate on such a model refuses to
measure, so a codec that zeroes every KV value cannot pass it.

Fast: the specs here train for two steps (a model that cannot recall, so training fails as it
must), and the model that "does not recall" is any model with its attention's output zeroed:
it never reads its context, so it answers the same with any KV."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.quality import QualityGate, RecallModel, RecallModelSpec, TrainingFailed
from kvtier.quality.model import _build, recall_model
from kvtier.storage.codecs import Buffer, PayloadCodec

QUICK = RecallModelSpec(short_steps=1, long_steps=1)  # trains in a second, never recalls


class Zeroing(PayloadCodec):
    """Stores nothing and loads zeros: every fact in the context is lost."""

    codec_id = 0xFF03
    name = "test-zeroing"
    lossless = False

    def encode(self, payload: memoryview, layout: KVLayout) -> Buffer:
        return b""

    def decode(self, stored: memoryview, out: memoryview, layout: KVLayout) -> int:
        torch.frombuffer(out, dtype=torch.uint8).zero_()
        return out.nbytes


def context_blind(spec: RecallModelSpec) -> torch.nn.Module:
    """A model of ``spec`` whose attention adds nothing: it never reads its context."""
    model: torch.nn.Module = _build(spec)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("self_attn.o_proj.weight"):
                weight.zero_()
    return model.eval()


def write_cache(directory: Path, spec: RecallModelSpec, weights: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"recall-{spec.digest()}.pt"
    torch.save({"weights": weights, "accuracy": 0.999}, path)  # what a forger would claim
    return path


def test_a_replaced_cache_file_that_does_not_recall_is_not_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_cache(tmp_path, QUICK, context_blind(QUICK).state_dict())
    # not loaded: trained again (two steps here, so the training itself is refused)
    with (
        caplog.at_level(logging.WARNING, logger="kvtier.quality"),
        pytest.raises(TrainingFailed, match="recomputed KV after 2 steps"),
    ):
        recall_model(QUICK, directory=tmp_path)
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(path) in line and "below the 93%" in line


def test_a_damaged_cache_file_is_trained_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / f"recall-{QUICK.digest()}.pt"
    path.write_bytes(b"not a torch archive")
    with (
        caplog.at_level(logging.WARNING, logger="kvtier.quality"),
        pytest.raises(TrainingFailed),
    ):
        recall_model(QUICK, directory=tmp_path)
    assert "cannot be read" in caplog.records[0].getMessage()


def test_a_loaded_model_reports_the_accuracy_measured_not_the_one_written(
    tmp_path: Path,
) -> None:
    lenient = RecallModelSpec(short_steps=1, long_steps=1, min_accuracy=0.0)
    write_cache(tmp_path, lenient, _build(lenient).state_dict())
    loaded = recall_model(lenient, directory=tmp_path)
    assert loaded.train_s == 0.0  # loaded, not trained
    assert loaded.accuracy < 0.5  # an untrained model's, not the 99.9% the file claims


def test_a_gate_on_a_model_that_does_not_recall_refuses_to_pass_a_zeroing_codec(
    tmp_path: Path,
) -> None:
    """However the model came (here: handed over with a claimed accuracy), the gate checks
    its own baseline before it judges a codec."""
    model = RecallModel(context_blind(QUICK), QUICK, tmp_path / "x.pt", 0.0, accuracy=0.999)
    with pytest.raises(TrainingFailed, match="do not recall"):
        QualityGate(model, sequences=8).check(Zeroing())
