"""The oracle: generation with KV served by kvtier equals generation without it."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier import Engine, InputError, KVLayout
from kvtier.integrations.sampling import Sampling
from kvtier.integrations.transformers import HFConnector, KVTierConnector
from tests.integrations.oracle import (
    CASE_IDS,
    CASES,
    CHUNK,
    make_engine,
    reference,
    tiny_model,
    tokens,
)

NEW = 12


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        assert engine.leaks() == []
        engine.flush(10)
        assert engine.check_invariants() == []
        engine.close()


def connect(engines: list[Engine], model: Any, **overrides: object) -> HFConnector:
    engine = make_engine(model, **overrides)
    engines.append(engine)
    return HFConnector(engine, model)


def check(conn: HFConnector, prompt: torch.Tensor, tol: float) -> Any:
    """Generate through kvtier and compare tokens and prefill logits with the reference."""
    want_tokens, want_logits = reference(conn.model, prompt, NEW)
    got = conn.generate(prompt, NEW)
    assert got.tokens == want_tokens
    pre = conn.prefill(prompt)
    assert torch.argmax(pre.logits.cpu()).item() == torch.argmax(want_logits).item()
    torch.testing.assert_close(pre.logits.float().cpu(), want_logits.float(), atol=tol, rtol=0)
    return got


@pytest.mark.parametrize(("family", "dtype", "tol"), CASES, ids=CASE_IDS)
def test_cached_prefix_matches_recompute(
    engines: list[Engine], family: str, dtype: torch.dtype, tol: float
) -> None:
    conn = connect(engines, tiny_model(family, dtype))
    base = tokens(5 * CHUNK + 7, seed=1)  # ends mid-chunk

    cold = check(conn, base, tol)
    assert cold.hit_tokens == 0 and cold.stored_chunks == 5

    # Shares 3 chunks + 9 tokens, then diverges: the hit ends at the last shared full chunk.
    branch = torch.cat([base[: 3 * CHUNK + 9], tokens(40, seed=2)])
    warm = check(conn, branch, tol)
    assert warm.hit_tokens == 3 * CHUNK and warm.reused_tokens == 3 * CHUNK

    # The same prompt again plus a turn: the whole stored prefix is reused.
    longer = torch.cat([base, tokens(30, seed=3)])
    assert check(conn, longer, tol).reused_tokens == 5 * CHUNK


@pytest.mark.parametrize(
    ("family", "dtype", "tol"), CASES[:1] + CASES[3:4], ids=CASE_IDS[:1] + CASE_IDS[3:4]
)
def test_entirely_cached_prompt_recomputes_last_token(
    engines: list[Engine], family: str, dtype: torch.dtype, tol: float
) -> None:
    conn = connect(engines, tiny_model(family, dtype))
    prompt = tokens(4 * CHUNK, seed=4)  # exactly 4 full chunks
    conn.generate(prompt, NEW)
    again = check(conn, prompt, tol)
    assert again.hit_tokens == 4 * CHUNK
    assert again.reused_tokens == 4 * CHUNK - 1  # the last token's logits are computed


def test_short_prompt_is_stored_only_with_save_unfull_chunk(engines: list[Engine]) -> None:
    model = tiny_model("llama", torch.float32)
    prompt = tokens(CHUNK - 5, seed=5)

    plain = connect(engines, model)
    first = check(plain, prompt, 1e-5)
    assert first.stored_chunks == 0 and plain.prefill(prompt).hit_tokens == 0

    partial = connect(engines, model, save_unfull_chunk=True)
    assert partial.generate(prompt, NEW).stored_chunks == 1
    again = check(partial, prompt, 1e-5)
    assert again.hit_tokens == CHUNK - 5 and again.reused_tokens == CHUNK - 6


def test_one_token_prompt(engines: list[Engine]) -> None:
    conn = connect(engines, tiny_model("qwen2", torch.float32), save_unfull_chunk=True)
    prompt = tokens(1, seed=6)
    check(conn, prompt, 1e-5)
    assert check(conn, prompt, 1e-5).reused_tokens == 0


def test_sliding_window_model_beyond_its_window(engines: list[Engine]) -> None:
    # The window masks old tokens; kvtier still caches and serves the whole prefix.
    conn = connect(engines, tiny_model("mistral", torch.float32, sliding_window=24))
    base = tokens(4 * CHUNK + 3, seed=8)
    check(conn, base, 1e-5)
    assert check(conn, torch.cat([base, tokens(9, seed=9)]), 1e-5).reused_tokens == 4 * CHUNK


def test_sampling_with_a_seed_is_the_same_with_and_without_cache(engines: list[Engine]) -> None:
    conn = connect(engines, tiny_model("llama", torch.float32))
    prompt = tokens(3 * CHUNK + 2, seed=10)
    sampling = Sampling(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=3)
    cold = conn.generate(prompt, NEW, sampling=sampling, use_cache=False, store=False)
    conn.generate(prompt, 1)
    warm = conn.generate(prompt, NEW, sampling=sampling)
    assert warm.reused_tokens == 3 * CHUNK and warm.tokens == cold.tokens


def test_stop_early_and_eos_end_generation_without_leaks(engines: list[Engine]) -> None:
    conn = connect(engines, tiny_model("llama", torch.float32))
    prompt = tokens(2 * CHUNK + 1, seed=11)
    full = conn.generate(prompt, NEW)
    early = conn.generate(prompt, NEW, stop=lambda toks: len(toks) == 3)
    assert early.stop_reason == "stop" and early.tokens == full.tokens[:3]
    eos = conn.generate(prompt, NEW, eos_token_id=full.tokens[1])
    assert eos.stop_reason == "eos" and eos.tokens == full.tokens[:2]
    assert conn.engine.leaks() == [] and conn.engine.stats()["pinned_pages"] == 0


def test_exception_mid_generation_releases_the_lease(engines: list[Engine]) -> None:
    conn = connect(engines, tiny_model("llama", torch.float32))
    prompt = tokens(3 * CHUNK, seed=12)
    conn.generate(prompt, 2)

    def boom(toks: list[int]) -> bool:
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        conn.generate(prompt, NEW, stop=boom)
    assert conn.engine.leaks() == [] and conn.engine.check_invariants() == []


def test_failure_between_lookup_and_load_releases_the_pins(
    engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = connect(engines, tiny_model("llama", torch.float32))
    prompt = tokens(3 * CHUNK, seed=13)
    conn.generate(prompt, 2)
    pinned: list[int] = []

    def fail_after_lookup(n: int) -> torch.Tensor:
        pinned.append(conn.engine.stats()["pinned_pages"])
        raise MemoryError("no room for the scratch buffer")

    monkeypatch.setattr(conn, "_scratch_for", fail_after_lookup)
    with pytest.raises(MemoryError):
        conn.generate(prompt, NEW)
    assert pinned == [3]  # the lookup did pin the hit ...
    assert conn.engine.leaks() == [] and conn.engine.stats()["pinned_pages"] == 0  # ... and no more


def test_batches_and_bad_prompts_are_refused(engines: list[Engine]) -> None:
    conn = connect(engines, tiny_model("llama", torch.float32))
    with pytest.raises(InputError, match="batches are not supported"):
        conn.generate(torch.zeros(2, 8, dtype=torch.long), 2)
    with pytest.raises(InputError, match="empty"):
        conn.generate([], 2)
    with pytest.raises(InputError, match="token ids"):
        conn.generate(torch.zeros(4), 2)
    with pytest.raises(InputError, match="max_new_tokens"):
        conn.generate([1, 2], 0)
    # A batch of one, as a [1, n] tensor, is fine.
    assert len(conn.generate(tokens(5, seed=14).unsqueeze(0), 3).tokens) == 3


def test_engine_for_another_layout_is_refused(engines: list[Engine]) -> None:
    model = tiny_model("llama", torch.float32)
    engine = make_engine(tiny_model("llama", torch.bfloat16))
    engines.append(engine)
    with pytest.raises(InputError, match="does not match"):
        HFConnector(engine, model)
    assert isinstance(engine.layout, KVLayout)


@pytest.mark.gpu
def test_model_on_cuda_with_kv_from_the_cpu_tier(engines: list[Engine]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")  # the gpu marker's skip: runs only where a GPU exists
    cuda_model = copy.deepcopy(tiny_model("llama", torch.float32)).to("cuda")
    conn = connect(engines, cuda_model)
    base = tokens(3 * CHUNK + 4, seed=15)
    want, _ = reference(cuda_model, base, NEW)
    assert conn.generate(base, NEW).tokens == want
    again = conn.generate(base, NEW)
    assert again.reused_tokens == 3 * CHUNK and again.tokens == want


def test_generate_reports_ttft_and_reused_tokens_to_the_engine(engines: list[Engine]) -> None:
    conn = connect(engines, tiny_model("llama", torch.float32))
    prompt = tokens(3 * CHUNK + 5, seed=11)
    first = conn.generate(prompt, 2)
    second = conn.generate(prompt, 2)
    conn.generate(prompt, 2, use_cache=False)  # the baseline path reports nothing
    totals = conn.engine.observer.ttft
    assert totals.requests == 2
    assert totals.hit_tokens == first.reused_tokens + second.reused_tokens == 3 * CHUNK
    assert totals.seconds == pytest.approx(first.ttft_s + second.ttft_s)


def test_the_former_name_still_imports_the_same_connector() -> None:
    assert KVTierConnector is HFConnector
