"""What names a vLLM request's KV besides its prompt tokens, as kvtier keys it.

vLLM's own prefix cache keys a block by its tokens and by "extra keys"
(``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``). kvtier asks that same
function for the extra keys of every chunk, so it keys by exactly what vLLM keys by, and
turns each kind into :class:`~kvtier.request_salt.ExtraKeys`::

    vLLM's extra key                      kvtier
    ("cache_salt", salt)   first block    ExtraKeys.salt: re-seeds every key of the request
    ("lora", name, path)   every block    ExtraKeys.adapter: a digest of the adapter's files
    ("mm", identifier, offset)            an item over the chunk: the item's content hash
    ("prompt_embeds", sha256)             an item over the chunk: a digest of its rows
    any other kind (a future vLLM's)      the request is not cached (fail closed)

Why the adapter's *content* and not its name: the name (and path) is what vLLM hashes, and
it lives only as long as vLLM's GPU blocks do; kvtier's disk and Redis tiers outlive the
process, and a redeploy may point the same name or path at new weights. A digest of the
adapter's files (xxh3-128 over every file under its path, kept while their sizes and mtimes
stay) names the weights themselves: two names of one adapter share their KV, one name of
two adapters never does. An adapter whose path kvtier cannot read (not a local file or
directory) is not cached.

A request with prompt embeddings and no token ids is keyed by placeholder ids (zeros, as
vLLM's own request holds them) plus its rows' digests, chunk by chunk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from kvtier.request_salt import ExtraKeys, RequestSalt, check_salt

log = logging.getLogger(__name__)

KNOWN_KINDS = ("cache_salt", "lora", "mm", "prompt_embeds")

ExtraKeysOf = Callable[[Any, int, int, int], tuple[tuple[Any, ...] | None, int]]


def _vllm_extra_keys() -> ExtraKeysOf | None:
    """vLLM's per-block extra keys, or None where this vLLM has no such function."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:  # another vLLM: requests with extra keys are then not cached
        return None
    return generate_block_hash_extra_keys


@dataclass(frozen=True, slots=True)
class Keyed:
    """A request as kvtier keys it: its tokens and salt, or why it is not cached."""

    tokens: list[int]
    salt: RequestSalt | None
    uncached: str | None = None  # the reason, for the log line and explain


class AdapterDigests:
    """Digests of LoRA adapters' files, kept per path while the files' sizes and mtimes
    stay (a stat per file per request; the files are read once)."""

    MAX_KEPT = 256

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple[tuple[str, int, int], ...], bytes]] = {}

    def digest(self, path: str) -> bytes | None:
        """The adapter at ``path`` (a file, or a directory of files), or None where it is
        not a local path kvtier can read."""
        try:
            files = _adapter_files(Path(path))
            stamp = tuple((str(f), st.st_size, st.st_mtime_ns) for f, st in files)
            kept = self._kept.get(path)
            if kept is not None and kept[0] == stamp:
                return kept[1]
            hasher = xxhash.xxh3_128()
            for name, _, _ in stamp:
                hasher.update(os.path.relpath(name, path).encode() + b"\x00")
                with open(name, "rb") as f:
                    while block := f.read(1 << 20):
                        hasher.update(block)
        except OSError:
            return None
        if not stamp:
            return None
        value = hasher.digest()
        if len(self._kept) >= self.MAX_KEPT:
            self._kept.clear()
        self._kept[path] = (stamp, value)
        return value


def _adapter_files(path: Path) -> list[tuple[Path, os.stat_result]]:
    if path.is_file():
        return [(path, path.stat())]
    if not path.is_dir():
        raise FileNotFoundError(path)
    found = [p for p in sorted(path.rglob("*")) if p.is_file()]
    return [(p, p.stat()) for p in found]


class RequestKeyer:
    """Turns vLLM requests into :class:`Keyed` (one per request, made by the scheduler side
    at the request's first hook)."""

    def __init__(self, chunk_size: int, extra_keys_of: ExtraKeysOf | None = None) -> None:
        self.chunk_size = chunk_size
        self._extra_keys_of = extra_keys_of or _vllm_extra_keys()
        self.adapters = AdapterDigests()

    def key(self, request: Any) -> Keyed:
        salt = getattr(request, "cache_salt", None) or None
        tokens = request.prompt_token_ids
        lora = getattr(request, "lora_request", None)
        features = getattr(request, "mm_features", None) or []
        embeds = getattr(request, "prompt_embeds", None)
        if tokens is None:
            # Prompt embeddings only: vLLM's request holds placeholder ids (zeros).
            tokens = list(request.all_token_ids[: request.num_prompt_tokens])
        if lora is None and not features and embeds is None:
            return Keyed(list(tokens), salt)  # the plain case: tokens and salt only
        if self._extra_keys_of is None:
            why = "this vLLM has no generate_block_hash_extra_keys to key its extra keys by"
            return Keyed([], salt, why)
        labels = _labels(lora, features, embeds)
        adapter = b""
        if lora is not None:
            found = self.adapters.digest(str(getattr(lora, "lora_path", "") or ""))
            if found is None:
                why = f"lora adapter {lora.lora_name!r}: its path is not local files kvtier reads"
                return Keyed([], salt, why)
            adapter = found
        items: list[tuple[int, int, bytes]] = []
        size, total = self.chunk_size, len(tokens)
        for start in range(0, total, size):
            end = min(start + size, total)
            extra, _ = self._extra_keys_of(request, start, end, 0)
            parts: list[Any] = []
            for key in extra or ():
                kind = key[0] if isinstance(key, tuple) and key else key
                if kind in ("cache_salt", "lora"):
                    continue  # in the seed: ExtraKeys.salt and .adapter
                if kind not in KNOWN_KINDS:
                    return Keyed([], salt, f"an extra key kvtier cannot key ({kind!r})")
                parts.append(list(key))
            if parts:
                items.append((start, end, xxhash.xxh3_128_digest(msgspec.msgpack.encode(parts))))
        tenant = f"lora:{lora.lora_name}" if lora is not None else ""  # docs/tenants.md
        keyed = check_salt(ExtraKeys(salt, adapter, tuple(items), labels, tenant))
        return Keyed(list(tokens), keyed)


def _labels(lora: Any, features: list[Any], embeds: Any) -> tuple[str, ...]:
    labels = [f"lora adapter {lora.lora_name!r}"] if lora is not None else []
    kinds: dict[str, int] = {}
    for feature in features:
        modality = str(getattr(feature, "modality", "") or "multimodal item")
        kinds[modality] = kinds.get(modality, 0) + 1
    for modality, count in kinds.items():
        labels.append(f"{count} {modality}{'s' if count > 1 else ''}")
    if embeds is not None:
        labels.append("prompt embeddings")
    return tuple(labels)
