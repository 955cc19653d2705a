"""A fleet behind vllm-router's ``kv_aware`` policy, fed by kvtier's KV events.

Real processes on loopback: redis-server, two vLLM OpenAI servers (one core each) with kvtier
(a CPU tier each, one shared Redis tier) publishing KV events, and vllm-router. vLLM's own
prefix cache is off in the fleet, so every credit the router gives comes from kvtier's events
(on today's main they were chunk-sized blocks the router ignores). Outputs are compared with
one vLLM server without a connector. The tests share the fleet and run in file order: kill
and restart change it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from benchmarks.harness.router import LossyLink, Router
from benchmarks.harness.vllm_server import VllmServer, post

from kvtier.demo.checkpoint import words_for
from tests.redis_servers import RedisServer
from tests.waiting import wait_until

from .vllm_helpers import Instances, tokens

pytestmark = pytest.mark.slow

CHUNK = 256
HOST_CREDIT = 0.8  # the router's default --kv-penalty-host


def prompt(*parts: tuple[int, int]) -> str:
    """Words for the tokens of each (length, seed) part, in order."""
    return words_for([t for n, seed in parts for t in tokens(n, seed)])


X1, Y1, Z1 = prompt((600, 1)), prompt((600, 2)), prompt((600, 3))
X2, Y2, Z2 = (p + " " + prompt((200, 10 + i)) for i, p in enumerate((X1, Y1, Z1)))
X3 = X2 + " " + prompt((100, 20))
WARM1, WARM2 = prompt((300, 30)), prompt((300, 31))  # a whole chunk each: an event batch
PROMPTS = [X1, Y1, Z1, X2, Y2, Z2, X3, WARM1, WARM2]
EXTERNAL_CREDIT = 0.6  # --kv-penalty-external: the Redis tier


@dataclass
class Fleet:
    a: VllmServer
    b: VllmServer
    router: Router
    reference: dict[str, str]

    def served(self, run: str) -> tuple[VllmServer, dict[str, int], str]:
        """Send ``run`` through the router: the instance that prefilled it, that instance's
        prompt tokens by source for this request, and the text."""
        live = [s for s in (self.a, self.b) if s.proc is not None and s.proc.poll() is None]
        before = {s.name: s.prompt_tokens() for s in live}
        text = self.router.complete(run)["choices"][0]["text"]
        time.sleep(1.0)  # the step's KV events reach the router
        for server in live:
            after = server.prompt_tokens()
            delta = {k: after[k] - before[server.name][k] for k in after}
            if any(delta.values()):
                return server, delta, str(text)
        raise AssertionError("no instance counted the request's prompt tokens")


def complete(url: str, run: str) -> str:
    body = {"model": "tiny", "prompt": run, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return str(post(f"{url}/v1/completions", body)["choices"][0]["text"])


@pytest.fixture(scope="module")
def fleet(
    model_dir: Path, instances: Instances, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    instances.close()  # at most one vLLM of the shared holder; the fleet starts its own
    work = tmp_path_factory.mktemp("fleet")
    # A core each from those this process may run on (a runner may be limited to others).
    cpus = sorted(os.sched_getaffinity(0))
    first, second = str(cpus[0]), str(cpus[1 % len(cpus)])
    plain = VllmServer("plain", model_dir, work, events=False, core=first).start().wait_ready()
    try:
        reference = {p: complete(plain.url, p) for p in PROMPTS}
    finally:
        plain.stop()
    redis = RedisServer().start()
    kvtier = {"max_local_cpu_size": "256MiB", "remote_url": redis.url, "chunk_size": CHUNK}
    a = VllmServer("a", model_dir, work, kvtier=kvtier, core=first, prefix_cache=False).start()
    b = VllmServer("b", model_dir, work, kvtier=kvtier, core=second, prefix_cache=False).start()
    router: Router | None = None
    try:
        a.wait_ready()
        b.wait_ready()
        router = Router([a, b], "kv_aware", work).start()
        yield Fleet(a, b, router, reference)
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()
        redis.stop()


def test_a_users_next_round_goes_to_the_instance_that_holds_its_kv(fleet: Fleet) -> None:
    held = int(HOST_CREDIT * 2 * CHUNK)  # round one stored two whole chunks in a CPU tier
    for first, second in ((X1, X2), (Y1, Y2)):
        holder, computed, text = fleet.served(first)
        assert computed["local_compute"] == 600 and text == fleet.reference[first]
        server, loaded, text = fleet.served(second)
        assert server is holder, "the router sent the next round away from its KV"
        assert loaded["external_kv_transfer"] == 2 * CHUNK  # kvtier's CPU tier, no prefill
        assert text == fleet.reference[second]
        url, credit = fleet.router.decisions()[-1]
        assert url == holder.url and credit >= held  # credited as a host-tier hit


def test_a_lost_event_batch_is_replayed(fleet: Fleet, tmp_path: Path) -> None:
    """A relay drops the batch that announced Z's chunks; the next batch shows the router a
    gap in vLLM's sequence numbers, it asks the instance's replay socket, and credits Z."""
    link = LossyLink(fleet.a.events_endpoint)
    router = Router([fleet.a], "kv_aware", tmp_path, sources={fleet.a.url: link.endpoint})
    try:
        router.start()
        assert link.subscribed.wait(30), "the router's SUB never joined the relay"
        link.drop_next()
        assert complete(router.url, Z1) == fleet.reference[Z1]
        wait_until(lambda: bool(link.dropped), 10, "the relay to drop Z1's event batch")
        complete(fleet.a.url, WARM1)  # a later batch: the gap shows
        # The router's debug log has a line for each batch it takes from the replay socket.
        replayed = re.compile(
            rf"replay sequence advanced source={re.escape(fleet.a.url)} rank=0 "
            rf"seq={link.dropped[0]}\b"
        )
        wait_until(
            lambda: bool(replayed.search(router.log_text())), 30, "the router to replay the batch"
        )
        assert complete(router.url, Z2) == fleet.reference[Z2]
        url, credit = router.decisions()[-1]
        assert url == fleet.a.url and credit >= int(HOST_CREDIT * 2 * CHUNK)
    finally:
        router.stop()
        link.close()


def test_a_killed_instance_gets_nothing_and_its_users_hit_redis(fleet: Fleet) -> None:
    holder, _, _ = fleet.served(X2)  # X's KV is where X1 went
    other = fleet.b if holder is fleet.a else fleet.a
    holder.kill()
    down = lambda: not fleet.router.healthy(holder.url)  # noqa: E731
    wait_until(down, 30, "the router's health check to mark the killed instance down")
    server, loaded, text = fleet.served(X3)
    assert server is other and text == fleet.reference[X3]
    assert loaded["external_kv_transfer"] >= 3 * CHUNK  # from the shared Redis tier
    assert all(url != holder.url for url, _ in fleet.router.decisions()[-1:])


def test_a_restarted_instance_is_not_credited_with_its_old_blocks(fleet: Fleet) -> None:
    """The restarted instance publishes from sequence 0 again: the router forgets what the
    old process held (it announced X's chunks in its CPU tier)."""
    dead = fleet.a if fleet.a.proc is not None and fleet.a.proc.poll() is not None else fleet.b
    dead.start().wait_ready()  # the same ports: the router still lists it
    complete(dead.url, WARM2)  # its first batch (sequence 0) tells the router it restarted
    restarted = lambda: "incarnation" in fleet.router.log_text()  # noqa: E731
    wait_until(restarted, 30, "the router to see the sequence restart")
    up = lambda: fleet.router.healthy(dead.url)  # noqa: E731
    wait_until(up, 30, "the router's health check to count the restarted instance up")
    _, _, text = fleet.served(X2)
    assert text == fleet.reference[X2]
    url, credit = fleet.router.decisions()[-1]
    if url == dead.url:
        # what it can still load (X's chunks in Redis), never what its old CPU tier held
        assert credit <= int(EXTERNAL_CREDIT * 3 * CHUNK) < int(HOST_CREDIT * 3 * CHUNK)
