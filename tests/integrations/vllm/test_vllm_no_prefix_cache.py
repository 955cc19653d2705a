"""kvtier in a real vLLM with vLLM's own prefix cache OFF: kvtier does all the reuse, so every
hit it offers is loaded, and every load that fails must leave the request recomputing, once.

One instance ("nocache") serves the file: prefix caching off, a CPU tier of 3 chunk pages
(so concurrent disk hits compete for pages), a disk tier, and a vLLM KV cache of 17 blocks
(so long decodes preempt). Requests run through ``LLMEngine.step`` with a deadline (and a
pytest timeout): a request that is offered a failing hit forever fails the test instead of
hanging it. Every output is compared token for token with vLLM alone (``reference``).
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import LONG, PROMPTS, lifecycle_prompts
from .test_vllm_connector import BLOCK, chunk_file, delta, metric_total
from .vllm_helpers import MAX_TOKENS, Instances, VllmInstance, tokens, unique_engine_id

pytestmark = pytest.mark.slow

CPU_PAGES = 3  # 1 MiB chunks (256 tokens x 4 KiB of KV per token)
DEADLINE_S = 150.0  # far above what these runs take; a wedged request never finishes


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier-nocache-disk")


def nocache(model_dir: Path, instances: Instances, disk: Path) -> VllmInstance:
    return instances.get(
        "nocache",
        lambda: VllmInstance(
            model_dir,
            engine_id=unique_engine_id("kvtier-test-nocache"),
            extra={
                "max_local_cpu_size": f"{CPU_PAGES}MiB",
                "local_disk": str(disk),
                "max_local_disk_size": "1GiB",
            },
            enable_prefix_caching=False,
            kv_cache_bytes=17 * BLOCK * 4096,  # 4 KiB of KV per token; preempts long decodes
            max_num_batched_tokens=512,
            max_num_seqs=12,
            max_model_len=2048,
            disable_log_stats=False,
        ),
    )


class Run:
    """Requests stepped through vLLM's engine until each finishes, or the deadline fails."""

    def __init__(self, instance: VllmInstance) -> None:
        self.engine = instance.llm.llm_engine
        self.live: set[str] = set()
        self.outputs: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}  # num_cached_tokens vLLM reports per request

    def add(
        self, rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS, salt: str | None = None
    ) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        inputs = TokensPrompt(prompt_token_ids=list(prompt))
        if salt is not None:
            inputs["cache_salt"] = salt
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, inputs, params)
        self.live.add(rid)

    def abort(self, rid: str) -> None:
        self.engine.abort_request([rid])
        self.live.discard(rid)

    def step(self) -> None:
        for out in self.engine.step():
            if out.finished:
                self.live.discard(out.request_id)
                self.outputs[out.request_id] = list(out.outputs[0].token_ids)
                self.cached[out.request_id] = int(out.num_cached_tokens or 0)

    def finish(self, deadline_s: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while self.live:
            if time.monotonic() > deadline:
                stuck = sorted(self.live)
                for rid in stuck:
                    self.abort(rid)
                pytest.fail(f"requests {stuck} never finished: a failed kvtier hit wedged them")
            self.step()


def generate(instance: VllmInstance, prompts: dict[str, list[int]], salt: str | None = None) -> Run:
    """Run ``prompts`` to the end, then wait until their disk writes have landed.

    The wait is the write protocol's completion signal (``flush``), and the tests here need
    it: a disk write holds its chunk's CPU page until it lands (``kvtier.storage.writes``),
    so with 3 pages a request that starts while the last one's writes still run gets its
    disk hit declined and its own store dropped, and a chunk is on disk only once its write
    landed. A loaded machine's slow fsync made exactly that happen (tests/storage/
    test_writes.py has it deterministically)."""
    run = Run(instance)
    for rid, prompt in prompts.items():
        run.add(rid, prompt, salt=salt)
    run.finish()
    assert instance.probe is not None and instance.probe.flush(30.0) is True
    return run


_FILLER_SEEDS = itertools.count(900)


def push_out_of_cpu(instance: VllmInstance) -> None:
    """Store 2 x 3 new chunks (more than every CPU page): what was stored before is on disk
    only."""
    seeds = [next(_FILLER_SEEDS) for _ in range(2)]
    generate(instance, {f"fill{seed}": tokens(800, seed=seed) for seed in seeds})


@pytest.mark.timeout(600, func_only=True)
def test_two_cache_salts_never_share_a_chunk(
    reference: dict[str, list[list[int]]], model_dir: Path, instances: Instances, disk_dir: Path
) -> None:
    """vLLM's per-request cache_salt keys kvtier's chunks: what a request salted tenant-A
    stored is a miss for tenant-B and for no salt (kvtier supplies 0 tokens, output equal
    to vLLM alone); tenant-A itself hits it."""
    llm = nocache(model_dir, instances, disk_dir)
    prompt = PROMPTS["salted"]
    s0 = llm.stats()
    run = generate(llm, {"a1": prompt}, salt="tenant-A")
    assert run.outputs["a1"] == reference["salted"][0] and run.cached["a1"] == 0
    s1 = llm.stats()
    assert delta(s1, s0, "stored_chunks") == 3

    for rid, salt in (("b1", "tenant-B"), ("none", None)):
        run = generate(llm, {rid: prompt}, salt=salt)
        assert run.outputs[rid] == reference["salted"][0]
        assert run.cached[rid] == 0, f"{rid}: kvtier served another tenant's KV"
    s2 = llm.stats()
    assert delta(s2, s1, "hit_tokens") == 0 and delta(s2, s1, "retrieved_tokens") == 0
    assert delta(s2, s1, "stored_chunks") == 6  # each salt stored its own copy
    # The CPU tier (3 pages) has evicted tenant-A's chunks for the others': A's hit comes from
    # disk (landed: generate waits for the writes).

    run = generate(llm, {"a2": prompt}, salt="tenant-A")
    assert run.outputs["a2"] == reference["salted"][0]
    assert run.cached["a2"] == 768  # 3 chunks, the same tenant
    s3 = llm.stats()
    assert delta(s3, s2, "retrieved_tokens") == 768
    llm.assert_clean(wait_s=5.0)


@pytest.mark.timeout(600, func_only=True)
def test_corrupt_and_deleted_disk_chunks_are_recomputed_once(
    reference: dict[str, list[list[int]]], model_dir: Path, instances: Instances, disk_dir: Path
) -> None:
    """Every disk chunk of one prompt corrupted, another prompt's files deleted under the
    live index: each request's load fails, vLLM reschedules it, and kvtier never offers
    the failed hit again: both finish, with vLLM's own output, after a bounded number of
    failed loads."""
    llm = nocache(model_dir, instances, disk_dir)
    # One at a time, as every request below: both at once want 5 pages of 3 while the first
    # chunks' writes may still hold theirs, and a dropped chunk has no file to break.
    generate(llm, {"c0": PROMPTS["corrupt"]})
    generate(llm, {"d0": PROMPTS["deleted"]})
    push_out_of_cpu(llm)
    for index in range(3):
        path = chunk_file(disk_dir, model_dir, PROMPTS["corrupt"], index)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    for index in range(2):
        chunk_file(disk_dir, model_dir, PROMPTS["deleted"], index).unlink()

    s0 = llm.stats()
    # One at a time: each hit gets its pages (3 CPU pages) and its load is really tried.
    run = generate(llm, {"c1": PROMPTS["corrupt"]})
    assert run.outputs["c1"] == reference["corrupt"][0]
    run = generate(llm, {"d1": PROMPTS["deleted"]})
    assert run.outputs["d1"] == reference["deleted"][0]
    s1 = llm.stats()
    assert delta(s1, s0, "retrieved_tokens") == 0  # nothing arrived
    # one per chunk read (3 + 2), not one per retry of a loop
    assert 2 <= delta(s1, s0, "load_failures") <= 10
    llm.assert_clean(wait_s=5.0)
    # They were recomputed and stored again: the next requests load them.
    run = generate(llm, {"c2": PROMPTS["corrupt"]})
    assert run.outputs["c2"] == reference["corrupt"][0] and run.cached["c2"] == 768
    run = generate(llm, {"d2": PROMPTS["deleted"]})
    assert run.outputs["d2"] == reference["deleted"][0] and run.cached["d2"] == 512
    llm.assert_clean(wait_s=5.0)


@pytest.mark.timeout(600, func_only=True)
def test_concurrent_disk_hits_beyond_the_cpu_tier_never_wedge(
    reference: dict[str, list[list[int]]], model_dir: Path, instances: Instances, disk_dir: Path
) -> None:
    """Six prompts whose 2 chunks each are on disk, asked at once (three fit in vLLM's KV
    cache together), with 3 CPU pages to load into: the hits that cannot get a page are
    declined at lookup (never promised and then failed with "no free CPU page"), every
    request finishes with vLLM's own output, and nothing stays held."""
    llm = nocache(model_dir, instances, disk_dir)
    names = [f"busy{i}" for i in range(6)]
    generate(llm, {f"{n}-store": PROMPTS[n] for n in names})
    push_out_of_cpu(llm)
    s0 = llm.stats()
    run = generate(llm, {n: PROMPTS[n] for n in names})
    for n in names:
        assert run.outputs[n] == reference[n][0], n
    s1 = llm.stats()
    assert delta(s1, s0, "retrieved_tokens") >= 512  # the hits that got pages loaded
    assert delta(s1, s0, "load_failures") == 0  # the others were declined, never failed
    llm.assert_clean(wait_s=5.0)


@pytest.mark.timeout(600, func_only=True)
def test_preemption_aborts_and_failing_loads_in_one_run(
    reference: dict[str, list[list[int]]], model_dir: Path, instances: Instances, disk_dir: Path
) -> None:
    """Requests over shared documents, some decoding long enough to be preempted (17 vLLM
    blocks), random aborts, and disk chunks of two documents corrupted after they were
    stored: every request that was not aborted finishes with vLLM's own output."""
    llm = nocache(model_dir, instances, disk_dir)
    prompts = lifecycle_prompts(120)
    generate(llm, {f"doc{i}": prompts[i] for i in range(8)})  # the documents, stored
    push_out_of_cpu(llm)
    for doc in (1, 2):  # chunk 0 of two documents fails its checksum on disk
        path = chunk_file(disk_dir, model_dir, prompts[doc], 0)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))

    rng = random.Random(5)
    max_tokens = {i: rng.choice([1, MAX_TOKENS, LONG, LONG]) for i in range(len(prompts))}
    before = llm.stats()
    run = Run(llm)
    pending = list(range(len(prompts)))
    aborted: set[str] = set()
    deadline = time.monotonic() + DEADLINE_S
    while pending or run.live:
        assert time.monotonic() < deadline, f"requests {sorted(run.live)} never finished"
        while pending and len(run.live) < 24:
            i = pending.pop(0)
            run.add(str(i), prompts[i], max_tokens[i])
        run.step()
        if run.live and rng.random() < 0.05:
            victim = rng.choice(sorted(run.live))
            run.abort(victim)
            aborted.add(victim)
    llm.assert_clean(wait_s=10.0)

    for rid, generated in run.outputs.items():
        i = int(rid)
        assert generated == reference["lifecycle"][i][: max_tokens[i]], f"request {i}"
    assert len(run.outputs) + len(aborted) == len(prompts) and aborted
    after = llm.stats()
    assert delta(after, before, "retrieved_tokens") > 0
    assert delta(after, before, "load_failures") >= 1  # the corrupted chunks were tried...
    assert delta(after, before, "load_failures") <= 12  # ...and never offered again
    metrics = {m.name: m for m in llm.llm.get_metrics()}
    assert metric_total(metrics["vllm:num_preemptions"]) > 0, "the KV cache never ran out"
    stats: dict[str, Any] = llm.stats()
    assert stats["open_requests"] == 0
