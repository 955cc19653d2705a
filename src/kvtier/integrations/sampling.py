"""Choosing the next token from logits: greedy, or sampling with temperature / top-k / top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import InputError


@dataclass(frozen=True, slots=True)
class Sampling:
    """``do_sample=False`` is greedy (argmax). With sampling, ``seed`` makes it repeatable."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise InputError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self) -> torch.Generator | None:
        if not self.do_sample:
            return None
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        return gen


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token id from one position's ``[vocab]`` logits."""
    if not sampling.do_sample:
        return int(torch.argmax(logits).item())
    scores = logits.float().cpu() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scores, min(sampling.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (always at least the best token).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
