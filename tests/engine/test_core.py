from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvtier import ConfigError, Engine, Hit, InputError, KVLayout, StateError
from kvtier.storage.base import PutJob
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.storage.dict_tier import DictTier

EngineFactory = Callable[..., Engine]


def test_retrieve_returns_exactly_the_stored_bytes(engine: Engine) -> None:
    tokens, kv = make_tokens(64), make_kv(64)
    assert engine.store(tokens, kv) == 4
    with engine.request("r"):
        assert engine.lookup(tokens + [1, 2, 3], "r").tokens == 64
        out = engine.retrieve(tokens + [1, 2, 3], "r")
    assert out.shape == kv.shape and torch.equal(out, kv)
    assert engine.leaks() == [] and engine.check_invariants() == []


def test_hit_stops_at_the_first_divergent_chunk(engine: Engine) -> None:
    tokens = make_tokens(64)
    engine.store(tokens, make_kv(64))
    other = tokens[:40] + [7] * 24  # diverges inside chunk 2
    assert engine.lookup(other, "r").tokens == 32
    engine.end_request("r")


def test_lookup_pins_until_end_request_and_a_second_end_is_a_no_op(engine: Engine) -> None:
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))
    engine.lookup(tokens, "r")
    stats = engine.stats()
    assert stats["pinned_pages"] == 3 and stats["pinned_by_request"]["r"]["pages"] == 3
    assert [leak.request_id for leak in engine.leaks()] == ["r"]
    assert engine.end_request("r") is True
    assert engine.end_request("r") is False
    assert engine.stats()["pinned_pages"] == 0 and engine.check_invariants() == []


def test_storing_a_present_key_takes_no_reference(engine: Engine) -> None:
    tokens, kv = make_tokens(32), make_kv(32)
    engine.store(tokens, kv)
    used = engine.stats()["allocator"]["pages_used"]
    assert engine.store(tokens, kv) == 0
    assert engine.stats()["allocator"]["pages_used"] == used
    assert engine.check_invariants() == []


def test_retrieve_into_writes_in_place_and_honours_skip(engine: Engine) -> None:
    tokens, kv = make_tokens(64), make_kv(64)
    engine.store(tokens, kv)
    out = torch.zeros(SMALL_LAYOUT.kv_shape(80))
    with engine.request("r"):
        assert engine.lookup(tokens, "r", skip_leading_tokens=20).tokens == 64
        assert engine.retrieve_into(tokens, "r", out, skip_leading_tokens=20) == 64
    assert torch.equal(out[:, :, 16:64], kv[:, :, 16:64])  # from the chunk holding token 20
    assert not out[:, :, :16].any()  # chunks the engine already holds are not loaded
    with pytest.raises(InputError, match="out must be"):
        engine.retrieve_into(tokens, "r2", torch.zeros(2, 2, 10, 16))
    engine.end_request("r2")


def test_retrieve_after_a_skipping_lookup_returns_the_real_skipped_chunks(engine: Engine) -> None:
    tokens, kv = make_tokens(64), make_kv(64)
    engine.store(tokens, kv)
    with engine.request("r"):
        assert engine.lookup(tokens, "r", skip_leading_tokens=32).tokens == 64
        out = engine.retrieve(tokens, "r")  # the skipped chunks are cached: loaded too
        assert out.shape == kv.shape and torch.equal(out, kv)
    assert engine.leaks() == [] and engine.check_invariants() == []


def test_retrieve_refuses_skipped_chunks_the_cache_does_not_hold(engine: Engine) -> None:
    tokens, kv = make_tokens(64), make_kv(64)
    assert engine.store(tokens, kv, skip_leading_tokens=32) == 2  # chunks 0 and 1 not stored
    with engine.request("r"):
        assert engine.lookup(tokens, "r", skip_leading_tokens=32).tokens == 64
        with pytest.raises(InputError, match=r"retrieve_into\(.*skip_leading_tokens=32"):
            engine.retrieve(tokens, "r")
        out = torch.zeros_like(kv)  # the way that works, as the error says
        assert engine.retrieve_into(tokens, "r", out, skip_leading_tokens=32) == 64
        assert torch.equal(out[:, :, 32:], kv[:, :, 32:])
    assert engine.leaks() == [] and engine.check_invariants() == []


def test_skip_leading_tokens_chunks_are_hashed_but_not_stored(engine: Engine) -> None:
    tokens, kv = make_tokens(64), make_kv(64)
    assert engine.store(tokens, kv, skip_leading_tokens=32) == 2
    assert engine.lookup(tokens, "r").tokens == 0  # chunk 0 is not cached
    assert engine.lookup(tokens, "s", skip_leading_tokens=32).tokens == 64
    with engine.request("t"):
        out = torch.zeros_like(kv)
        engine.retrieve_into(tokens, "t", out, skip_leading_tokens=32)
        assert torch.equal(out[:, :, 32:], kv[:, :, 32:])
    engine.end_request("r")
    engine.end_request("s")


def test_partial_chunk_only_with_save_unfull_chunk(engine_factory: EngineFactory) -> None:
    tokens, kv = make_tokens(40), make_kv(40)
    plain = engine_factory()
    plain.store(tokens, kv)
    assert plain.lookup(tokens, "r").tokens == 32
    plain.end_request("r")
    unfull = engine_factory(save_unfull_chunk=True)
    assert unfull.store(tokens, kv) == 3
    with unfull.request("r"):
        assert unfull.lookup(tokens, "r").tokens == 40
        assert torch.equal(unfull.retrieve(tokens, "r"), kv)


def test_another_model_never_matches(engine_factory: EngineFactory) -> None:
    a = engine_factory(model_name="a")
    tokens = make_tokens(32)
    a.store(tokens, make_kv(32))
    b = engine_factory(model_name="b")
    b.store(make_tokens(32, seed=5), make_kv(32))
    assert b.lookup(tokens, "r").tokens == 0
    b.end_request("r")


def test_full_of_pinned_pages_store_drops_and_retrieve_fails_cleanly(
    engine_factory: EngineFactory,
) -> None:
    engine = engine_factory(cpu_chunks=2)
    first = make_tokens(32, seed=1)
    engine.store(first, make_kv(32, seed=1))
    assert engine.lookup(first, "holder").tokens == 32  # both pages pinned
    assert engine.store(make_tokens(32, seed=2), make_kv(32, seed=2)) == 0
    assert engine.stats()["dropped_chunks"] == 2
    engine.end_request("holder")
    assert engine.store(make_tokens(32, seed=2), make_kv(32, seed=2)) == 2  # evicts now
    assert engine.check_invariants() == []


def test_cpu_buffer_is_rounded_down_to_whole_chunks(layout: KVLayout) -> None:
    chunk = layout.chunk_bytes(SMALL_CHUNK)
    cfg = small_config(max_local_cpu_size=f"{3 * chunk + chunk - 1}B")
    assert Engine(cfg, layout, model_name="m").num_pages == 3
    with pytest.raises(ConfigError) as info:
        Engine(small_config(max_local_cpu_size=f"{chunk - 1}B"), layout, model_name="m")
    assert info.value.key == "max_local_cpu_size"


def test_absurd_cpu_size_is_refused_before_allocating(layout: KVLayout) -> None:
    with pytest.raises(ConfigError, match="machine's memory"):
        Engine(small_config(max_local_cpu_size="900TiB"), layout, model_name="m")


@pytest.mark.parametrize(
    ("kv", "tokens", "fragment"),
    [
        (torch.zeros(2, 2, 16, 16, dtype=torch.float64), 16, "dtype"),
        (torch.zeros(2, 3, 16, 16), 16, "shape"),
        (torch.zeros(2, 2, 16, 15), 16, "shape"),
        (torch.zeros(2, 2, 15, 16), 16, "holds 15 tokens but 16"),
        (np.zeros((2, 2, 16, 16), dtype=np.float32), 16, "torch.Tensor"),
    ],
)
def test_bad_kv_is_an_input_error_and_nothing_stored_is_lost(
    engine: Engine, kv: object, tokens: int, fragment: str
) -> None:
    kept_tokens, kept_kv = make_tokens(32, seed=9), make_kv(32, seed=9)
    engine.store(kept_tokens, kept_kv)
    with pytest.raises(InputError, match=fragment):
        engine.store(make_tokens(tokens), kv)  # type: ignore[arg-type]
    with engine.request("r"):
        assert torch.equal(engine.retrieve(kept_tokens, "r"), kept_kv)


@pytest.mark.parametrize("request_id", ["", None, 3])
def test_bad_request_id(engine: Engine, request_id: object) -> None:
    with pytest.raises(InputError, match="request_id"):
        engine.lookup(make_tokens(16), request_id)  # type: ignore[arg-type]


def test_bad_tokens_are_input_errors(engine: Engine) -> None:
    with pytest.raises(InputError, match="empty"):
        engine.lookup([], "r")
    with pytest.raises(InputError, match="integers"):
        engine.store([1.5] * 16, make_kv(16))
    with pytest.raises(InputError, match="skip_leading_tokens"):
        engine.lookup(make_tokens(16), "r", skip_leading_tokens=-1)


def test_lifecycle_states(layout: KVLayout) -> None:
    engine = Engine(small_config(), layout, model_name="m")
    with pytest.raises(StateError, match="call open"):
        engine.lookup(make_tokens(16), "r")
    with engine:
        engine.store(make_tokens(16), make_kv(16))
        engine.lookup(make_tokens(16), "left-open")
    engine.close()  # idempotent
    with pytest.raises(StateError, match="closed"):
        engine.stats()
    with pytest.raises(StateError, match="closed"):
        engine.open()


def test_request_context_ends_the_lease_on_exceptions(engine: Engine) -> None:
    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    with pytest.raises(RuntimeError), engine.request("r"):
        engine.lookup(tokens, "r")
        raise RuntimeError("model crashed")
    assert engine.leaks() == []


def test_retrieve_without_lookup_looks_up_itself(engine: Engine) -> None:
    tokens, kv = make_tokens(32), make_kv(32)
    engine.store(tokens, kv)
    assert torch.equal(engine.retrieve(tokens, "r"), kv)
    assert engine.stats()["pinned_by_request"]["r"]["pages"] == 2
    engine.end_request("r")


def test_stats_report_hits_and_allocator(engine: Engine) -> None:
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))
    engine.lookup(tokens[:40], "r")
    engine.retrieve(tokens[:40], "r")
    engine.end_request("r")
    stats = engine.stats()
    assert stats["lookups"] == 1 and stats["lookup_tokens"] == 40 and stats["hit_tokens"] == 32
    assert stats["miss_tokens"] == 8
    assert stats["hit_tokens_by_tier"] == {"cpu": 32}
    assert stats["allocator"] == {
        "page_bytes": 4096,
        "pages_total": 8,
        "pages_free": 5,
        "pages_used": 3,
    }
    assert stats["tiers"]["cpu"]["entries"] == 3 and stats["requests"] == 1


def test_gpu_tensors_round_trip(engine: Engine) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")  # the gpu marker's skip: runs only where a GPU exists
    tokens, kv = make_tokens(32), make_kv(32).cuda()
    engine.store(tokens, kv)
    out = torch.zeros_like(kv)
    with engine.request("r"):
        engine.retrieve_into(tokens, "r", out)
    assert torch.equal(out, kv)


test_gpu_tensors_round_trip = pytest.mark.gpu(test_gpu_tensors_round_trip)


def test_a_hold_for_an_ended_request_is_released_not_leaked(engine: Engine) -> None:
    from kvtier.lease import CallbackHold

    released: list[str] = []
    engine.lookup(make_tokens(16), "decoder-request")
    engine.end_request("decoder-request")  # the decoder gave up waiting and prefilled locally
    late = CallbackHold(4096, "PD reservation", lambda: released.append("late"))
    with pytest.raises(StateError, match="already ended"):
        engine.receiver_host().attach_hold("decoder-request", late)
    assert released == ["late"] and engine.leaks() == []


def test_requests_of_two_salts_never_share_a_chunk(engine: Engine) -> None:
    tokens, kv = make_tokens(48), make_kv(48)
    assert engine.store(tokens, kv, cache_salt="tenant-A") == 3
    assert engine.lookup(tokens, "b", cache_salt="tenant-B").tokens == 0
    assert engine.lookup(tokens, "plain").tokens == 0  # nor with no salt at all
    assert engine.lookup(tokens, "a", cache_salt="tenant-A").tokens == 48
    assert torch.equal(engine.retrieve(tokens, "a", cache_salt="tenant-A"), kv)
    for rid in ("a", "b", "plain"):
        engine.end_request(rid)
    # an unsalted store is not visible to a salted request either
    other, other_kv = make_tokens(32, seed=9), make_kv(32, seed=9)
    engine.store(other, other_kv)
    assert engine.lookup(other, "s", cache_salt="tenant-A").tokens == 0
    engine.end_request("s")
    # the server's page API keys by the salt too
    slots = engine.pages().reserve_pages(other, "w", cache_salt="tenant-B")
    assert len(slots) == 2
    engine.end_request("w")
    end, pages = engine.pages().lease_pages(tokens, "p", cache_salt="tenant-B")
    assert (end, pages) == (0, [])
    engine.end_request("p")
    assert engine.check_invariants() == []


def test_a_lookup_says_how_much_of_its_hit_is_in_the_cpu_tier(
    engine_factory: EngineFactory, tmp_path: object
) -> None:
    engine = engine_factory(local_disk=str(tmp_path), max_local_disk_size="1MiB")
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))
    assert engine.lookup(tokens, "r") == Hit(48, 48)
    engine.end_request("r")
    assert engine.flush(10.0)
    cpu = engine.tier("cpu")
    assert cpu is not None
    cpu.clear()  # the chunks are on disk only now
    assert engine.lookup(tokens, "d") == Hit(48, 0)
    assert torch.equal(engine.retrieve(tokens, "d"), make_kv(48))
    engine.end_request("d")
    assert engine.check_invariants() == []


def test_a_buffer_of_only_the_tokens_after_the_skip_stores_and_loads_the_same_bytes(
    engine: Engine,
) -> None:
    """kv_start / out_start: a caller that saves or loads the chunks after its skip needs a
    buffer of those tokens only (the vLLM worker's per-step scratch), and the bytes that land
    are the ones a whole-prompt buffer would give."""
    chunk = engine.config.chunk_size
    tokens, kv = make_tokens(5 * chunk, 4101), make_kv(5 * chunk, 4101)
    assert engine.store(tokens[: 2 * chunk], kv[:, :, : 2 * chunk]) == 2
    tail = kv[:, :, 2 * chunk :].clone()  # only the tokens after the first two chunks
    stored = engine.store(tokens, tail, skip_leading_tokens=2 * chunk, kv_start=2 * chunk)
    assert stored == 3
    with engine.request("r"):
        assert engine.lookup(tokens, "r").tokens == 5 * chunk
        out = torch.full(engine.layout.kv_shape(4 * chunk), float("nan"))
        end = engine.retrieve_into(tokens, "r", out, skip_leading_tokens=chunk + 3, out_start=chunk)
        assert end == 5 * chunk
        assert torch.equal(out, kv[:, :, chunk:])  # every row written, none of the skip's
    assert engine.leaks() == [] and engine.check_invariants() == []


@pytest.mark.parametrize(
    ("name", "start_of"),
    [
        ("kv_start", lambda chunk: chunk // 2),  # not a chunk start
        ("kv_start", lambda chunk: 2 * chunk),  # after the skip
        ("out_start", lambda chunk: -chunk),
        ("out_start", lambda chunk: True),
    ],
)
def test_a_buffer_start_that_is_not_a_chunk_start_before_the_skip_is_refused(
    engine: Engine, name: str, start_of: Callable[[int], object]
) -> None:
    chunk = engine.config.chunk_size
    start, skip = start_of(chunk), chunk
    tokens, kv = make_tokens(4 * chunk, 4102), make_kv(4 * chunk, 4102)
    with pytest.raises(InputError, match=rf"{name} is .*multiple of chunk_size"):
        if name == "kv_start":
            engine.store(tokens, kv, skip_leading_tokens=skip, kv_start=start)  # type: ignore[arg-type]
        else:
            out = torch.zeros(engine.layout.kv_shape(4 * chunk))
            engine.retrieve_into(tokens, "r", out, skip_leading_tokens=skip, out_start=start)  # type: ignore[arg-type]
    assert engine.stats()["stored_chunks"] == 0  # nothing stored by a refused call


class _LateWrites(DictTier):
    """A lower tier whose writes land a while after the store that queued them (as a disk
    or Redis write does on its writer thread); ``flush`` waits for them, as theirs does."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: list[threading.Timer] = []

    def put(self, job: PutJob) -> None:
        land = threading.Timer(0.2, super().put, (replace(job, payload=job.payload.clone()),))
        self.queued.append(land)
        land.start()

    def flush(self, timeout: float | None = None) -> bool:
        for land in self.queued:
            land.join(timeout)
        return not any(land.is_alive() for land in self.queued)


def test_a_clear_takes_the_writes_queued_before_it_too() -> None:
    """vLLM's reset_prefix_cache clears kvtier's tiers: a write still queued then must not
    bring a chunk back after the clear."""
    tier = _LateWrites()
    chunk = SMALL_CHUNK
    with Engine(small_config(), SMALL_LAYOUT, model_name="m", lower_tiers=[tier]) as engine:
        tokens, kv = make_tokens(3 * chunk, 4105), make_kv(3 * chunk, 4105)
        assert engine.store(tokens, kv) == 3
        assert engine.clear()["dict"] == 3  # the queued writes landed first, then went
        time.sleep(0.3)  # past when a write queued before the clear would have landed
        assert tier.store == {}
        with engine.request("r"):
            assert engine.lookup(tokens, "r").tokens == 0
