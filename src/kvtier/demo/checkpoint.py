"""A tiny Llama-style checkpoint written by code: seeded random weights, no download.

vLLM loads models from files, so tests, ``python -m benchmarks vllm``, ``kvtier demo --engine
vllm`` and the docs' vLLM commands (``kvtier tiny-model DIR``) need a real checkpoint on disk.
:func:`write_tiny_llama` writes one into a directory (:func:`write_tiny_model` the same for
another of :data:`FAMILIES`, and :data:`SIZES` names the shapes a user can pick):

    config.json              LlamaConfig (4 layers, hidden 256, 4 heads / 2 KV heads)
    model.safetensors        random weights from ``torch.manual_seed(seed)``
    tokenizer.json + ...     a word-level tokenizer over ``w0 .. w{vocab-4}`` plus specials,
                             and a chat template (:data:`CHAT_TEMPLATE`)

:func:`write_lora_adapter` writes a LoRA adapter for it in PEFT's format.

The weights are random, so the "text" is meaningless, but vLLM loads them for real (not
``load_format=dummy``) and transformers loads the very same files, so both engines can be
compared. The same seed always writes the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import InputError

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2

# vLLM's /v1/chat/completions answers HTTP 400 for a tokenizer without a chat template. The
# turns' texts joined by spaces, no role markers: the vocabulary has no words for them, and
# plain joining makes each turn's prompt start with the whole of the last one (its reply
# included), so a multi-turn chat hits the cache as a real model's template would.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %} {% endif -%}"
    "{{- message['content'] -}}"
    "{%- endfor -%}"
)

# Decoder-only families vLLM and transformers both run with the same weights' names: the
# config class and the model class in transformers.
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


@dataclass(frozen=True, slots=True)
class TinyLlama:
    """The shape of the checkpoint; defaults are the model the vLLM tests and bench run."""

    num_layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 16384

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# The shapes ``kvtier tiny-model --size`` offers. ``tiny`` is the vLLM tests' model; ``small``
# and ``medium`` are the shapes of ``kvtier demo --model-size`` (kvtier.demo.tiny_models), where
# a prefill costs enough on a CPU for a cache hit to show in TTFT.
SIZES: dict[str, TinyLlama] = {
    "tiny": TinyLlama(),
    "small": TinyLlama(hidden=512, heads=8, kv_heads=2, intermediate=1408, vocab=4096),
    "medium": TinyLlama(hidden=1024, heads=16, kv_heads=2, intermediate=2816, vocab=8192),
}


def write_tiny_llama(path: str | Path, shape: TinyLlama | None = None, *, seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer into ``path`` (created if missing)."""
    return write_tiny_model(path, "llama", shape, seed=seed)


def write_tiny_model(
    path: str | Path, family: str = "llama", shape: TinyLlama | None = None, *, seed: int = 0
) -> Path:
    """:func:`write_tiny_llama` for any of :data:`FAMILIES` (the same shape and tokenizer)."""
    import transformers

    if family not in FAMILIES:
        raise InputError(f"model family {family!r} is unknown; use one of {', '.join(FAMILIES)}")
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    shape = shape or TinyLlama()
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise InputError(
            f"TinyLlama: hidden ({shape.hidden}) must divide by heads ({shape.heads}) and heads "
            f"by kv_heads ({shape.kv_heads})"
        )
    if shape.vocab <= len(SPECIALS):
        raise InputError(f"TinyLlama.vocab must be above {len(SPECIALS)}, got {shape.vocab}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        # Wider than the usual 0.02: random logits with clear winners keep greedy decoding
        # away from near-ties, so a rounding difference between batch shapes cannot flip a
        # token when cached KV replaces recomputed KV.
        initializer_range=0.08,
        tie_word_embeddings=False,
        unk_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    if family == "mistral":
        # No sliding window: every family then caches every token, as the tests expect.
        settings["sliding_window"] = None
    config = config_class(**settings)
    # Initialization draws from torch's global generator: restore it afterwards so writing a
    # checkpoint does not change the caller's later random draws.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(out)
    # The template in tokenizer_config.json's ``chat_template`` field, not the newer
    # chat_template.jinja file, which older transformers (a CUDA vLLM's) do not read.
    _tokenizer(shape.vocab).save_pretrained(out, save_jinja_files=False)
    return out


def _tokenizer(vocab: int):  # type: ignore[no-untyped-def]
    """A word-level tokenizer: ``w17`` is token 17 + 3; unknown words map to ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(SPECIALS)}
    words.update({f"w{i}": i + len(SPECIALS) for i in range(vocab - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token=SPECIALS[0],
        bos_token=SPECIALS[1],
        eos_token=SPECIALS[2],
        chat_template=CHAT_TEMPLATE,
    )


def words_for(tokens: list[int]) -> str:
    """The text that the tiny tokenizer turns back into ``tokens`` (all ids >= 3)."""
    if any(t < len(SPECIALS) for t in tokens):
        raise InputError("words_for: special token ids (0, 1, 2) have no word")
    return " ".join(f"w{t - len(SPECIALS)}" for t in tokens)


def write_lora_adapter(
    path: str | Path, shape: TinyLlama | None = None, *, seed: int, rank: int = 8
) -> Path:
    """A LoRA adapter for :func:`write_tiny_llama`'s model, in PEFT's format (what vLLM's
    ``LoRARequest`` loads): nonzero random A and B on every layer's q and v projections, so
    each seed changes the model's KV and its greedy tokens."""
    import json

    from safetensors.torch import save_file

    shape = shape or TinyLlama()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    kv_width = shape.kv_heads * shape.head_dim
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.num_layers):
        for name, width in (("q_proj", shape.hidden), ("v_proj", kv_width)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            a = torch.randn(rank, shape.hidden, generator=generator) * 0.5
            b = torch.randn(width, rank, generator=generator) * 0.5
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    save_file(tensors, str(out / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(settings))
    return out
