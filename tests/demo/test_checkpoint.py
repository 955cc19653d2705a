"""The tiny checkpoint vLLM loads: real files that transformers reads back the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.demo.checkpoint import TinyLlama, words_for, write_tiny_llama
from kvtier.errors import InputError


def test_transformers_loads_the_written_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = TinyLlama(num_layers=2, hidden=64, heads=2, kv_heads=1, intermediate=96, vocab=64)
    path = write_tiny_llama(tmp_path / "m", shape, seed=5)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 1
    again = write_tiny_llama(tmp_path / "again", shape, seed=5)
    assert (path / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    other = write_tiny_llama(tmp_path / "other", shape, seed=6)
    assert (path / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = [3, 17, 60]
    assert tok(words_for(ids), add_special_tokens=False)["input_ids"] == ids
    assert tok.decode(ids) == words_for(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()


def test_bad_shapes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="must divide"):
        write_tiny_llama(tmp_path, TinyLlama(hidden=100, heads=3))
    with pytest.raises(InputError, match="special token"):
        words_for([1, 5])


def test_the_tokenizer_has_a_chat_template_so_chat_completions_work(tmp_path: Path) -> None:
    """vLLM's /v1/chat/completions answers 400 for a tokenizer without one (issue 58, item 7).
    The turns are joined with spaces: each turn's prompt then starts with the last one's, so
    a multi-turn chat hits the cache."""
    import json

    from transformers import AutoTokenizer

    shape = TinyLlama(num_layers=1, hidden=64, heads=2, kv_heads=1, intermediate=96, vocab=64)
    path = write_tiny_llama(tmp_path / "m", shape)
    # In tokenizer_config.json, where every transformers version (and so vLLM) looks.
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    chat = [
        {"role": "system", "content": words_for([3])},
        {"role": "user", "content": words_for([4, 5])},
    ]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == words_for([3, 4, 5])
    assert tok(text, add_special_tokens=False)["input_ids"] == [3, 4, 5]
    follow_up = [*chat, {"role": "assistant", "content": "w9"}, {"role": "user", "content": "w7"}]
    longer = tok.apply_chat_template(follow_up, tokenize=False, add_generation_prompt=True)
    assert longer.startswith(text + " ")
