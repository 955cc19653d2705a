"""A hypothesis state machine over request lifecycles with the disk tier present.

Requests look up, retrieve, end, end again and get aborted (ended without a retrieve) in
any interleaving, while stores, flushes and CPU evictions happen, on a CPU buffer of only
four chunks, in each of the three tier roles. After every step the reference counts are
consistent; at the end, once writes land, nothing is pinned anywhere and every page is free
or owned by a cache entry. Every byte retrieved is the byte stored.
"""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier import Engine
from kvtier.storage.disk.tier import DiskTier
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config

BASES = 3
MAX_TOKENS = 64
LENGTHS = st.sampled_from([8, 16, 24, 40, 64])
REQUESTS = st.sampled_from(["a", "b", "c"])
ROLES = {
    "cpu-cache": {"local_cpu": True},
    "cpu-staging-visible": {"local_cpu": False, "use_only_staging_buffer": False},
    "staging-only": {"local_cpu": False, "use_only_staging_buffer": True},
}


class DiskLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtier-disk-sm-")
        self.engine: Engine | None = None
        self.tokens = [make_tokens(MAX_TOKENS, 50 + b) for b in range(BASES)]
        self.kv = [make_kv(MAX_TOKENS, 50 + b) for b in range(BASES)]

    @initialize(role=st.sampled_from(sorted(ROLES)), disk_chunks=st.sampled_from([3, 8, 64]))
    def open_engine(self, role: str, disk_chunks: int) -> None:
        record = 4096 + SMALL_LAYOUT.chunk_bytes(16)
        cfg = small_config(
            cpu_chunks=4,
            save_unfull_chunk=True,
            local_disk=self.dir,
            max_local_disk_size=f"{disk_chunks * record}B",
            **ROLES[role],
        )
        self.engine = Engine(cfg, SMALL_LAYOUT, model_name="sm-model").open()

    @property
    def e(self) -> Engine:
        assert self.engine is not None
        return self.engine

    @rule(base=st.integers(0, BASES - 1), n=LENGTHS)
    def store(self, base: int, n: int) -> None:
        self.e.store(self.tokens[base][:n], self.kv[base][:, :, :n])

    @rule(rid=REQUESTS, base=st.integers(0, BASES - 1), n=LENGTHS)
    def lookup(self, rid: str, base: int, n: int) -> None:
        hit = self.e.lookup(self.tokens[base][:n], rid).tokens
        assert 0 <= hit <= n

    @rule(rid=REQUESTS, base=st.integers(0, BASES - 1), n=LENGTHS)
    def retrieve(self, rid: str, base: int, n: int) -> None:
        got = self.e.retrieve(self.tokens[base][:n], rid)
        assert torch.equal(got, self.kv[base][:, :, : got.shape[2]])

    @rule(rid=REQUESTS, base=st.integers(0, BASES - 1), n=LENGTHS)
    def abort(self, rid: str, base: int, n: int) -> None:
        """A request that looks up, then dies before it retrieves."""
        self.e.lookup(self.tokens[base][:n], rid)
        assert self.e.end_request(rid) is True
        assert self.e.end_request(rid) is False

    @rule(rid=REQUESTS)
    def end_request(self, rid: str) -> None:
        self.e.end_request(rid)
        assert self.e.end_request(rid) is False  # a repeat is a no-op

    @rule()
    def flush(self) -> None:
        assert self.e.flush(10)
        assert self.e.check_invariants() == []  # with writes landed: the full check

    @rule()
    def evict_cpu(self) -> None:
        manager = self.e._open_parts()[0]  # the state machine looks inside on purpose
        assert manager is not None
        manager.cpu.clear()

    @invariant()
    def references_are_consistent(self) -> None:
        """Every reference has an owner at every step, writes still landing included."""
        if self.engine is None:
            return
        assert self.e.check_invariants() == []

    def teardown(self) -> None:
        try:
            if self.engine is not None:
                engine = self.engine
                for rid in ("a", "b", "c"):
                    engine.end_request(rid)
                assert engine.flush(10)
                assert engine.check_invariants() == []
                manager = engine._open_parts()[0]
                assert manager is not None
                pool = manager.pool
                assert pool.free_pages + len(manager.cpu.owned_pages()) == pool.num_pages
                (disk,) = manager.lower
                assert isinstance(disk, DiskTier)
                assert disk.counters.pinned_keys == 0
                assert disk.counters.corrupt == 0
                engine.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


DiskLifecycle.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestDiskLifecycle = DiskLifecycle.TestCase
