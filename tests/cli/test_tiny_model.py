"""``kvtier tiny-model DIR``: a checkpoint transformers (and so vLLM) reads, and the command."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.cli.tiny_model import MARKER
from kvtier.demo.checkpoint import FAMILIES, SIZES


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_writes_a_checkpoint_autoconfig_loads_and_prints_how_to_serve_it(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "model"
    assert main(["tiny-model", str(out), "--family", family]) == 0
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    assert config.model_type == family
    assert (config.num_hidden_layers, config.hidden_size) == (4, 256)  # the tests' model
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).vocab_size == 1024

    printed = capsys.readouterr().out
    assert str(out.resolve()) in printed.splitlines()[0]
    command = shlex.split(printed.splitlines()[1].split(": ", 1)[1])
    assert command[command.index("--model") + 1] == str(out.resolve())
    assert "vllm.entrypoints.openai.api_server" in command
    assert command[command.index("--shutdown-timeout") + 1] == "30"  # kvtier's writes land
    connector = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert connector["kv_connector"] == "KVTierConnector"


def test_writing_again_over_its_own_checkpoint_is_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model"
    assert main(["tiny-model", str(out), "--seed", "3"]) == 0
    first = (out / "model.safetensors").read_bytes()
    assert main(["tiny-model", str(out), "--seed", "3"]) == 0  # the docs' block, run twice
    assert (out / "model.safetensors").read_bytes() == first
    assert (out / MARKER).exists()


def test_a_directory_holding_other_files_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")  # someone's real model, say
    assert main(["tiny-model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: tiny-model: ") and str(tmp_path) in err
    assert (tmp_path / "config.json").read_text() == "{}"


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_offered_size_is_a_valid_shape(size: str) -> None:
    """The writer refuses a shape whose heads do not divide; catch that here, not at a user's."""
    shape = SIZES[size]
    assert shape.hidden % shape.heads == 0 and shape.heads % shape.kv_heads == 0
