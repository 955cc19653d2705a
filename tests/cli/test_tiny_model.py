"""``kvtier tiny-model DIR``: a checkpoint transformers (and so vLLM) reads, and the command."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.cli.tiny_model import MARKER, PARTIAL
from kvtier.config import Config
from kvtier.demo.checkpoint import FAMILIES, SIZES
from tests.hosts import needs_root

NOBODY = 65534  # another local user


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
    # docs/vllm.md's CPU block: without a reserved CPU decode runs 2-3x slower; and a tier
    # sized for the tiny model, not the 5 GiB default, allocated and touched at start.
    env = dict(word.split("=", 1) for word in command[: command.index("python")])
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    extra = connector["kv_connector_extra_config"]
    assert Config.load(overrides=extra, overrides_from="test").max_local_cpu_size == 1 << 30


def test_writing_again_over_its_own_checkpoint_is_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model"
    assert main(["tiny-model", str(out), "--seed", "3"]) == 0
    first = (out / "model.safetensors").read_bytes()
    assert main(["tiny-model", str(out), "--seed", "3"]) == 0  # the docs' block, run twice
    assert (out / "model.safetensors").read_bytes() == first
    assert (out / MARKER).exists()
    assert not [name for name in os.listdir(out) if name.startswith(PARTIAL)]  # staging gone


def test_a_directory_holding_other_files_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")  # someone's real model, say
    assert main(["tiny-model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: tiny-model: ") and str(tmp_path) in err
    assert (tmp_path / "config.json").read_text() == "{}"


@needs_root
def test_a_directory_another_user_made_is_refused_even_with_the_marker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The docs' /tmp/tiny-llama, made first by another user with a marker of their own:
    root writing there would write wherever that user's names lead."""
    squatted = tmp_path / "tiny-llama"
    squatted.mkdir(mode=0o755)
    (squatted / MARKER).write_text("llama tiny seed 0\n")
    os.chown(squatted / MARKER, NOBODY, -1)
    os.chown(squatted, NOBODY, -1)
    assert main(["tiny-model", str(squatted)]) == 2
    err = capsys.readouterr().err
    assert str(squatted) in err and f"owned by uid {NOBODY}" in err
    assert os.listdir(squatted) == [MARKER]  # nothing written


def test_a_symlinked_marker_is_not_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "secret"
    victim.write_text("root only")
    victim.chmod(0o600)
    out = tmp_path / "model"
    out.mkdir(mode=0o755)
    (out / MARKER).symlink_to(victim)  # a link named like the marker proves nothing
    assert main(["tiny-model", str(out)]) == 2
    assert MARKER in capsys.readouterr().err
    assert victim.read_text() == "root only"
    assert os.listdir(out) == [MARKER]


def test_a_link_inside_its_own_checkpoint_is_replaced_not_written_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "secret"
    victim.write_text("root only")
    out = tmp_path / "model"
    assert main(["tiny-model", str(out)]) == 0
    for name in ("config.json", "model.safetensors"):
        (out / name).unlink()
        (out / name).symlink_to(victim)
    assert main(["tiny-model", str(out)]) == 0
    assert victim.read_text() == "root only"
    for name in ("config.json", "model.safetensors"):
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 0


def test_a_dangling_symlink_as_dir_is_refused_and_its_target_not_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "elsewhere"
    link = tmp_path / "tiny-llama"
    link.symlink_to(target)
    assert main(["tiny-model", str(link)]) == 2
    err = capsys.readouterr().err
    assert str(link) in err and "symbolic link" in err
    assert not os.path.lexists(target)


def test_a_directory_others_can_write_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model"
    out.mkdir()
    out.chmod(0o777)  # ours, but anyone could add or swap a name in it
    assert main(["tiny-model", str(out)]) == 2
    assert "0777" in capsys.readouterr().err
    assert os.listdir(out) == []


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_offered_size_is_a_valid_shape(size: str) -> None:
    """The writer refuses a shape whose heads do not divide; catch that here, not at a user's."""
    shape = SIZES[size]
    assert shape.hidden % shape.heads == 0 and shape.heads % shape.kv_heads == 0
