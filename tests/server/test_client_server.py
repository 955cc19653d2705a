"""The client against a real server process: the Engine surface, byte for byte."""

from __future__ import annotations

import os
import stat
from typing import Any

import numpy as np
import pytest
import torch

import kvtier
from kvtier import Engine, InputError, StateError
from kvtier.keys import RequestKeys
from kvtier.lifecycle import Lifecycle
from kvtier.service import Service
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.server.conftest import SPAWN
from tests.server.server_helpers import (
    IDLE,
    ServerProcess,
    idle_server_state,
    open_client,
    wait_until,
    zeros_like_kv,
)
from tests.server.workers import fetch_prompt, store_prompt


def test_connect_store_lookup_retrieve(server: ServerProcess) -> None:
    tokens, kv = make_tokens(100, 1), make_kv(100, 1)
    with kvtier.connect(server.url, SMALL_LAYOUT, model_name="test-model",
                        config=small_config()) as client:  # fmt: skip
        assert client.connected
        assert client.store(tokens, kv) == 6  # 6 whole chunks of 16; the tail is not stored
        assert client.store(tokens, kv) == 0  # already held
        with client.request("r1"):
            assert client.lookup(tokens + [5], "r1").tokens == 96
            got = client.retrieve(tokens + [5], "r1")
            assert torch.equal(got, kv[:, :, :96])
            out = zeros_like_kv(120)
            assert client.retrieve_into(tokens, "r1", out) == 96
            assert torch.equal(out[:, :, :96], kv[:, :, :96])
            assert client.stats()["open_requests"] == 1
        assert idle_server_state(client) == IDLE


def test_the_engine_and_the_client_refuse_the_same_calls_with_the_same_words(
    server: ServerProcess,
) -> None:
    """One validation for both surfaces (kvtier.cache.KVCache): each bad call is refused
    before it reaches the server, in the words the in-process engine uses."""
    tokens, kv = make_tokens(32, 7), make_kv(32, 7)
    engine = Engine(small_config(), SMALL_LAYOUT, model_name="same-words")
    with engine, open_client(server.url, model_name="same-words") as client:
        other = kvtier.Engine(small_config(), SMALL_LAYOUT, model_name="other").keychain
        foreign = RequestKeys(other, np.asarray(tokens, dtype=np.int32), None, False)
        calls: list[Any] = [
            lambda c: c.lookup(tokens, ""),
            lambda c: c.lookup(tokens, "r", skip_leading_tokens=-1),
            lambda c: c.lookup(tokens, "r", cache_salt=7),
            lambda c: c.retrieve_into(tokens, "r", torch.zeros(3)),
            lambda c: c.store(tokens, torch.zeros(2, 3, 32, 16)),
            lambda c: c.store(tokens, kv, keys=c.request_keys(tokens[:16])),
            lambda c: c.store(tokens, kv, keys=foreign),
            lambda c: c.end_request(""),
            lambda c: c.request_keys(tokens, ""),
            lambda c: c.record_ttft(-1.0, prompt_tokens=4, hit_tokens=0),
            lambda c: c.record_ttft(1.0, prompt_tokens=4, hit_tokens=5),
        ]
        for call in calls:
            words = []
            for cache in (engine, client):
                with pytest.raises(InputError) as refused:
                    call(cache)
                words.append(str(refused.value))
            assert words[0] == words[1]
        assert client.connected and client.unserved == 0  # nothing went to the server
        assert engine.stats()["open_requests"] == 0 and engine.check_invariants() == []


def test_same_answers_as_an_in_process_engine(server: ServerProcess) -> None:
    """The same calls on an Engine and on the client give the same hits, KV and counts."""
    base = make_tokens(64, 2)
    prompts = [base + make_tokens(40, 3), base + make_tokens(70, 4), make_tokens(50, 5)]
    engine = Engine(small_config(cpu_chunks=64), SMALL_LAYOUT, model_name="same")
    with engine, open_client(server.url, model_name="same") as client:
        for cache in (engine, client):
            cache.store(prompts[0], make_kv(104, 6))
        for i, prompt in enumerate(prompts):
            answers: list[Any] = []
            for cache in (engine, client):
                rid = f"same-{i}"
                hit = cache.lookup(prompt, rid, skip_leading_tokens=16)
                out = zeros_like_kv(len(prompt))
                end = cache.retrieve_into(prompt, rid, out, skip_leading_tokens=16)
                stored = cache.store(prompt, make_kv(len(prompt), 7), skip_leading_tokens=16)
                cache.end_request(rid)
                answers.append((hit, end, out, stored))
            (h1, e1, o1, s1), (h2, e2, o2, s2) = answers
            assert (h1, e1, s1) == (h2, e2, s2)
            assert torch.equal(o1, o2)


def test_second_process_hits_what_the_first_stored(server: ServerProcess) -> None:
    results = SPAWN.Queue()
    writer = SPAWN.Process(target=store_prompt, args=(server.url, 200, 11, results))
    writer.start()
    assert results.get(timeout=60) == 12
    writer.join(30)
    with open_client(server.url) as watcher:
        cpu_hits = watcher.stats()["hit_tokens_by_tier"].get("cpu", 0)
        reader = SPAWN.Process(target=fetch_prompt, args=(server.url, 200, 11, results))
        reader.start()
        hit, same = results.get(timeout=60)
        reader.join(30)
        assert (hit, same) == (192, True)
        # the writer is gone; its chunks were served from the server's CPU tier
        assert watcher.stats()["hit_tokens_by_tier"]["cpu"] == cpu_hits + 192
    assert writer.exitcode == reader.exitcode == 0


def test_other_fingerprints_share_the_server_not_the_chunks(server: ServerProcess) -> None:
    tokens, kv = make_tokens(64, 21), make_kv(64, 21)
    with open_client(server.url, model_name="model-a") as a:
        assert a.store(tokens, kv) == 4
        models_before = a.stats()["server"]["models"]
        others = [
            open_client(server.url, model_name="model-b"),
            open_client(server.url, model_name="model-a", cache_salt="tenant-2"),
            open_client(server.url, model_name="model-a", chunk_size=32),
            open_client(
                server.url,
                kvtier.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
                model_name="model-a",
            ),
        ]
        for other in others:
            assert other.connected
            assert other.lookup(tokens, "x").tokens == 0
            assert other.stats()["tiers"]["cpu"]["entries"] == 0  # an engine of its own
            other.close()
        assert a.lookup(tokens, "x").tokens == 64
        assert a.stats()["server"]["models"] == models_before + 4


def test_bad_arguments_raise_as_in_process(server: ServerProcess) -> None:
    with open_client(server.url) as client:
        with pytest.raises(InputError, match="kv shape"):
            client.store(make_tokens(32), torch.zeros(2, 3, 32, 16))
        with pytest.raises(InputError, match="request_id"):
            client.lookup(make_tokens(32), "")
        with pytest.raises(InputError, match="out must be"):
            client.retrieve_into(make_tokens(32), "r", torch.zeros(3))
        with pytest.raises(InputError, match="tokens"):
            client.lookup([], "r")
        assert client.connected  # bad input is the caller's: the connection stays
    with pytest.raises(StateError, match="closed"):
        client.lookup(make_tokens(32), "r")
    with pytest.raises(StateError, match="new"):
        kvtier.ServerClient(server.url, SMALL_LAYOUT, model_name="m").lookup([1], "r")


def test_end_request_twice_is_a_no_op(server: ServerProcess) -> None:
    with open_client(server.url) as client:
        tokens = make_tokens(48, 31)
        client.store(tokens, make_kv(48, 31))
        assert client.lookup(tokens, "twice").tokens == 48
        assert client.end_request("twice") is True
        assert client.end_request("twice") is False
        assert idle_server_state(client) == IDLE


def test_socket_is_private(server: ServerProcess) -> None:
    mode = os.stat(server.path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


def test_closing_a_client_releases_its_leases(server: ServerProcess) -> None:
    tokens = make_tokens(64, 41)
    with open_client(server.url) as watcher:
        holder = open_client(server.url)
        holder.store(tokens, make_kv(64, 41))
        assert holder.lookup(tokens, "a").tokens == 64
        assert holder.lookup(tokens, "b").tokens == 64
        assert watcher.stats()["pinned_pages"] == 8
        holder.close()  # no end_request: the connection's end releases both
        wait_until(lambda: watcher.stats()["pinned_pages"] == 0, what="leases released")
        assert idle_server_state(watcher) == IDLE


def test_a_service_holds_the_server_client_it_is_given(server: ServerProcess) -> None:
    tokens, kv = make_tokens(32, 91), make_kv(32, 91)
    for url, kind in ((None, Engine), (server.url, kvtier.ServerClient)):
        client = (
            None
            if url is None
            else kvtier.ServerClient(url, SMALL_LAYOUT, model_name="either", config=small_config())
        )
        service = Service(small_config(), SMALL_LAYOUT, model_name="either", cache=client).open()
        try:
            cache = service.cache
            assert isinstance(cache, kind)
            # in process: the engine is local; through a server: none here
            assert (service.local_engine is cache) is (url is None)
            assert isinstance(service.local_engine, Engine) is (url is None)
            assert cache.store(tokens, kv) == 2
            with cache.request("r"):
                assert cache.lookup(tokens, "r").tokens == 32
            assert cache.check_invariants() == []
            assert service.admin is None and service.receiver is None
        finally:
            service.close()
        assert cache.state is Lifecycle.CLOSED
    client = kvtier.ServerClient(server.url, SMALL_LAYOUT, model_name="either")
    with pytest.raises(StateError, match="holds a ServerClient: no engine runs here"):
        _ = Service(small_config(), SMALL_LAYOUT, model_name="either", cache=client).engine


def test_a_buffer_of_only_the_tokens_after_the_skip_goes_through_the_server(
    server: ServerProcess,
) -> None:
    """kv_start / out_start through the shared pages: the client copies in from and out to
    a buffer whose row 0 is a later token, the bytes the engine's own surface gives."""
    with open_client(server.url, model_name="buffer-start") as client:
        chunk = client.config.chunk_size
        tokens, kv = make_tokens(4 * chunk, 4103), make_kv(4 * chunk, 4103)
        assert client.store(tokens, kv[:, :, chunk:].clone(), kv_start=chunk,
                            skip_leading_tokens=chunk) == 3  # fmt: skip
        assert client.store(tokens[:chunk], kv[:, :, :chunk]) == 1
        with client.request("r"):
            assert client.lookup(tokens, "r").tokens == 4 * chunk
            out = torch.full(SMALL_LAYOUT.kv_shape(2 * chunk), float("nan"))
            end = client.retrieve_into(
                tokens, "r", out, skip_leading_tokens=2 * chunk, out_start=2 * chunk
            )
            assert end == 4 * chunk and torch.equal(out, kv[:, :, 2 * chunk :])
        assert idle_server_state(client) == IDLE
