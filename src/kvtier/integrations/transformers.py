"""The transformers connector: prefix caching for decoder-only models with a ``DynamicCache``.

Protocol of one request (:meth:`HFConnector.prefill`)::

    lookup(tokens, rid)          longest cached prefix, pinned in the request's lease
    retrieve_into(tokens, rid)   chunk pages -> scratch [2, L, hit, H*D] (one copy per chunk)
    DynamicCache <- views        per layer one strided view; the cache copies it once
    end_request(rid)             in a finally: the pins go whatever happens next
    model(tokens[reused:], position_ids=reused..n-1, past_key_values=cache)

    then store(prefill): the chunks not loaded go back to kvtier (full chunks, and the last
    partial one when save_unfull_chunk is on); chunks already cached are skipped.

The lease is ended as soon as the KV sits in the request's own cache, so nothing a caller does
afterwards (stopping early, raising in a callback, abandoning a stream) can leave a pin behind.

A prompt that is entirely cached still needs the last token's logits, so at most
``len(prompt) - 1`` tokens are reused and the last one is recomputed (its KV is identical).

Layer-wise loads (``layerwise=True``, :mod:`kvtier.integrations.hf_layerwise`): the hit lands
in host staging instead of the device scratch, and each layer's KV is copied to the device while
the layer before it computes; a copy that fails or comes late makes the request a miss (the
whole prompt is recomputed), never a half-loaded KV.

One connector serves one model and is not thread-safe (it reuses a scratch buffer); use one
per thread, sharing the :class:`~kvtier.Engine`.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine import Engine
from kvtier.errors import InputError
from kvtier.integrations.hf_kv import (
    cache_from_kv,
    kv_from_cache,
    latent_split,
    layout_from_model,
)
from kvtier.integrations.hf_layerwise import LayerLoadFailed, LayerwiseLoads
from kvtier.integrations.sampling import Sampling, pick_token
from kvtier.memory.device import CopyEngine, DeviceCopies


@dataclass
class Prefill:
    """A prompt's prefill: its cache (holding all prompt tokens) and last-position logits."""

    request_id: str
    tokens: torch.Tensor  # 1-D int64 on the CPU
    cache: Any  # transformers DynamicCache, owned by this request alone
    logits: torch.Tensor  # [vocab], the prediction after the last prompt token
    hit_tokens: int  # prefix kvtier found
    loaded_tokens: int  # prefix kvtier delivered (a lower-tier miss can make it shorter)
    reused_tokens: int  # prefix taken from kvtier instead of computed (<= len - 1)
    load_s: float  # lookup + retrieve + building the cache
    compute_s: float  # the forward pass over the rest

    @property
    def computed_tokens(self) -> int:
        return len(self.tokens) - self.reused_tokens


@dataclass
class Generation:
    """What :meth:`HFConnector.generate` produced, with its timing."""

    prompt_tokens: int
    tokens: list[int]  # the new tokens only
    ttft_s: float  # request start -> first new token chosen (lookup and load included)
    total_s: float
    hit_tokens: int
    reused_tokens: int
    stored_chunks: int
    stop_reason: str  # "length", "eos" or "stop"
    timings: dict[str, float] = field(default_factory=dict)


class HFConnector:
    """Connects one transformers causal LM to a kvtier :class:`~kvtier.Engine`.

    ``engine=None`` runs the very same prefill/decode loop with no cache at all: the baseline
    that ``kvtier demo`` and ``python -m benchmarks ttft`` compare against.

    ``layerwise``: load a hit layer by layer behind the forward (module docstring);
    ``copies``: who copies host staging to the device then (a test's may land late);
    ``late_after_s``: how long a layer waits for its copy before the request is recomputed.
    """

    def __init__(
        self,
        engine: Engine | None,
        model: Any,
        *,
        layerwise: bool = False,
        copies: CopyEngine | None = None,
        late_after_s: float = 30.0,
    ) -> None:
        layout = layout_from_model(model)
        if engine is not None and engine.layout != layout:
            raise InputError(
                f"the engine's layout ({engine.layout.describe()}) does not match the model's "
                f"({layout.describe()}); build it with layout_from_model(model)"
            )
        self.engine = engine
        self.model = model
        self.layout = layout
        self.latent_split = latent_split(model)  # MLA: where transformers splits the latent
        self.chunk_size = engine.config.chunk_size if engine is not None else 1
        self.device = _model_device(model)
        self._scratch: torch.Tensor | None = None
        self.layerwise: LayerwiseLoads | None = None
        if layerwise and engine is not None:
            self.layerwise = LayerwiseLoads(
                layout,
                self.device,
                copies if copies is not None else DeviceCopies(),
                chunk_size=self.chunk_size,
                latent_split_at=self.latent_split,
                late_after_s=late_after_s,
            )
        self._ids = itertools.count()
        self._prefix = f"hf-{os.getpid()}-{id(self):x}"

    # -- the pieces ----------------------------------------------------------------------
    def prefill(
        self, prompt: object, *, request_id: str | None = None, use_cache: bool = True
    ) -> Prefill:
        """Prefill ``prompt`` reusing its cached prefix (``use_cache=False``: no kvtier at all).

        Does not store: call :meth:`store` when convenient (e.g. after the first token).
        """
        from transformers import DynamicCache

        tokens = prompt_tokens(prompt)
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        start = time.perf_counter()
        hit = loaded = reused = 0
        cache = DynamicCache()
        if use_cache and self.engine is not None:
            try:
                hit = self.engine.lookup(tokens, rid).tokens
                if hit:
                    layerwise = self.layerwise
                    out = (
                        self._scratch_for(hit) if layerwise is None else layerwise.staging_for(hit)
                    )
                    loaded = self.engine.retrieve_into(tokens, rid, out)
                    reused = min(loaded, len(tokens) - 1)
                    if layerwise is not None and reused:
                        cache = layerwise.begin(out, reused)  # loads as the forward asks
                    else:
                        cache = cache_from_kv(
                            out, self.layout, reused, latent_split_at=self.latent_split
                        )
            finally:
                self.engine.end_request(rid)
        loaded_at = time.perf_counter()
        try:
            logits, cache = self._forward(tokens[reused:], cache, reused)
            load = getattr(cache, "kvtier_load", None)
            if load is not None:
                load.finish()  # every layer loaded, or LayerLoadFailed
                cache.kvtier_load = None
        except LayerLoadFailed:
            # A layer's KV never arrived: the whole prompt is a miss (the layers before it
            # computed over the cached prefix, so nothing of this forward is kept).
            loaded = reused = 0
            logits, cache = self._forward(tokens, DynamicCache(), 0)
        return Prefill(
            request_id=rid,
            tokens=tokens,
            cache=cache,
            logits=logits,
            hit_tokens=hit,
            loaded_tokens=loaded,
            reused_tokens=reused,
            load_s=loaded_at - start,
            compute_s=time.perf_counter() - loaded_at,
        )

    def store(self, prefill: Prefill) -> int:
        """Store the prompt's chunks that did not come from kvtier. Returns chunks stored.

        Reads the cache's first ``len(prompt)`` positions only, so it may be called after
        decoding has extended the cache.
        """
        if self.engine is None:
            return 0
        n = len(prefill.tokens)
        start = (prefill.loaded_tokens // self.chunk_size) * self.chunk_size
        if start >= n:
            return 0
        kv = kv_from_cache(
            prefill.cache, self.layout, n, start=start, latent_split_at=self.latent_split
        )
        return self.engine.store(prefill.tokens, kv, skip_leading_tokens=start)

    def decode_step(self, cache: Any, token: int, position: int) -> torch.Tensor:
        """Feed ``token`` at ``position``; returns the next ``[vocab]`` logits."""
        ids = torch.tensor([token], dtype=torch.long)
        logits, _ = self._forward(ids, cache, position)
        return logits

    # -- the whole loop --------------------------------------------------------------------
    def generate(
        self,
        prompt: object,
        max_new_tokens: int = 32,
        *,
        sampling: Sampling | None = None,
        eos_token_id: int | None = None,
        stop: Callable[[list[int]], bool] | None = None,
        request_id: str | None = None,
        use_cache: bool = True,
        store: bool = True,
    ) -> Generation:
        """Prefill with the cached prefix, store the new chunks, decode up to
        ``max_new_tokens``. ``stop(tokens_so_far)`` returning True ends generation early."""
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = sampling or Sampling()
        generator = sampling.generator()
        start = time.perf_counter()
        pre = self.prefill(prompt, request_id=request_id, use_cache=use_cache)
        new = [pick_token(pre.logits, sampling, generator)]
        ttft = time.perf_counter() - start
        if self.engine is not None and use_cache:
            # Feeds the admin dashboard's "TTFT saved" and kvtier_ttft_seconds.
            self.engine.record_ttft(
                ttft, prompt_tokens=len(pre.tokens), hit_tokens=pre.reused_tokens
            )
        stored = self.store(pre) if store else 0
        stored_at = time.perf_counter()
        reason = "length"
        position = len(pre.tokens)
        while True:
            if eos_token_id is not None and new[-1] == eos_token_id:
                reason = "eos"
                break
            if stop is not None and stop(new):
                reason = "stop"
                break
            if len(new) >= max_new_tokens:
                break
            logits = self.decode_step(pre.cache, new[-1], position)
            position += 1
            new.append(pick_token(logits, sampling, generator))
        end = time.perf_counter()
        return Generation(
            prompt_tokens=len(pre.tokens),
            tokens=new,
            ttft_s=ttft,
            total_s=end - start,
            hit_tokens=pre.hit_tokens,
            reused_tokens=pre.reused_tokens,
            stored_chunks=stored,
            stop_reason=reason,
            timings={
                "load_s": pre.load_s,
                "prefill_s": pre.compute_s,
                "store_s": stored_at - ttft - start,
                "decode_s": end - stored_at,
            },
        )

    # -- helpers ---------------------------------------------------------------------------
    def _forward(
        self, ids: torch.Tensor, cache: Any, first_position: int
    ) -> tuple[torch.Tensor, Any]:
        # Positions are explicit: the cached prefix was computed at 0..first_position-1, and
        # RoPE'd keys are only valid there.
        positions = torch.arange(first_position, first_position + len(ids), device=self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(self.device).unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[0, -1], out.past_key_values

    def _scratch_for(self, tokens: int) -> torch.Tensor:
        """A reusable ``[2, L, >=tokens, hidden]`` buffer: fresh memory is slow to touch."""
        if self._scratch is None or self._scratch.shape[2] < tokens:
            capacity = -(-tokens // self.chunk_size) * self.chunk_size
            self._scratch = torch.empty(
                self.layout.kv_shape(capacity), dtype=self.layout.dtype, device=self.device
            )
        return self._scratch


def prompt_tokens(prompt: object) -> torch.Tensor:
    """A prompt as a 1-D int64 CPU tensor; a batch of more than one prompt is refused."""
    if isinstance(prompt, torch.Tensor):
        ids = prompt
    else:
        try:
            ids = torch.as_tensor(prompt)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InputError(f"prompt must be token ids, got {type(prompt).__name__}") from exc
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise InputError(
                f"batches are not supported: got {ids.shape[0]} prompts; call once per prompt"
            )
        ids = ids[0]
    if ids.dim() == 1 and len(ids) == 0:
        raise InputError("prompt is empty")
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(
            f"prompt must be a 1-D sequence of token ids, got shape {tuple(ids.shape)}"
        )
    return ids.detach().to("cpu", torch.long)


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    for param in model.parameters():
        return torch.device(param.device)
    return torch.device("cpu")


# The name this connector had before the vLLM connector took it too: kept so that users'
# ``from kvtier.integrations.transformers import KVTierConnector`` goes on working.
KVTierConnector = HFConnector
