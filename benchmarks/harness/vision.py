"""A tiny Idefics3-style vision-language checkpoint written by code: no download.

vLLM's CPU build runs Idefics3 (LLaVA, PaliGemma, Qwen-VL and Gemma-3 vision need
torchvision, which has no CPU build for this torch). :func:`write_tiny_idefics3` writes:

    config.json                 Idefics3Config: a 2-layer Llama text model (hidden 128), a
                                1-layer SigLIP-style vision tower on 64x64 images, 16x16
                                patches, pixel shuffle 2: 4 image tokens a picture
    model.safetensors           random weights from ``torch.manual_seed(seed)``
    tokenizer.json + ...        the word-level tokenizer of :mod:`.checkpoint` plus the image
                                tokens (``<fake_token_around_image>``, ``<image>``, ...)
    processor_config.json       Idefics3Processor with the PIL image processor, no splitting

A prompt puts ``<image>`` where the picture goes; vLLM's processor expands it to 7 tokens
(``<fake_token_around_image> <global-img> <image> x4 <fake_token_around_image>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvtier.demo.checkpoint import SPECIALS

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
WORDS_FROM = len(SPECIALS) + len(IMAGE_TOKENS)  # id of "w0"
IMAGE_SIZE = 64
TOKENS_PER_IMAGE = 7


def write_tiny_idefics3(path: str | Path, *, vocab: int = 1024, seed: int = 0) -> Path:
    """Write config, weights, tokenizer and processor into ``path`` (created if missing)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    text = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.08,  # clear winners: greedy tokens do not flip on rounding
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=16,
        initializer_range=0.08,
    )
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        scale_factor=2,
        image_token_id=len(SPECIALS) + IMAGE_TOKENS.index("<image>"),
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)  # type: ignore[no-untyped-call]
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(out)
    _processor(vocab).save_pretrained(out)
    return out


def _processor(vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    names = [*SPECIALS, *IMAGE_TOKENS]
    words = {name: i for i, name in enumerate(names)}
    words.update({f"w{i}": i + len(names) for i in range(vocab - len(names))})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token=SPECIALS[0],
        bos_token=SPECIALS[1],
        eos_token=SPECIALS[2],
        additional_special_tokens=list(IMAGE_TOKENS),
    )
    images = Idefics3ImageProcessorPil(
        do_resize=True,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
    )
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4)


def words(ids: list[int]) -> str:
    """Prompt text for word ids (``w<id>``), which the tokenizer maps one word a token."""
    return " ".join(f"w{i}" for i in ids)
