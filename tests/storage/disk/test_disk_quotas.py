"""tenant_quotas in the disk tier (``kvtier.storage.disk.quotas``): a flooding tenant stays
within its share of the directory, another keeps its files, and both the files' tenants and a
quota set at run time survive a restart."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier import Engine
from kvtier.config.sizes import GIB
from kvtier.config.tenant_quotas import TenantLimit
from kvtier.keys import ChunkKey
from kvtier.storage.cpu import CpuTier
from kvtier.storage.disk import quotas
from kvtier.storage.disk.index import DiskEntry, DiskIndex
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.policy import make_policy
from kvtier.storage.records import HEADER_SIZE
from kvtier.storage.tenants.local import TenantPolicy
from kvtier.storage.tenants.quotas import TenantQuotas
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.storage.disk.disk_helpers import RECORD_BYTES, make_tier
from tests.storage.tenant_contract import TenantContract, TenantTierFactory

FILE_BYTES = HEADER_SIZE + SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)
PROMPT = 4 * SMALL_CHUNK


def open_engine(directory: Path, **overrides: object) -> Engine:
    config = small_config(
        cpu_chunks=8,
        local_disk=str(directory),
        max_local_disk_size=f"{16 * FILE_BYTES}B",
        **{"tenant_quotas": {"flood": "25%", "*": "50%"}, **overrides},
    )
    return Engine(config, SMALL_LAYOUT, model_name="disk-quotas").open()


def disk_tenants(engine: Engine) -> dict[str, dict[str, int | None]]:
    engine.flush()
    tenants: dict[str, dict[str, int | None]] = engine.stats()["tiers"]["disk"]["tenants"]
    return tenants


def test_a_flooding_tenant_stays_within_its_disk_quota_and_it_survives_a_restart(
    tmp_path: Path,
) -> None:
    quiet = make_tokens(PROMPT, 1)
    with open_engine(tmp_path) as engine:
        engine.store(quiet, make_kv(PROMPT, 1), cache_salt="quiet")
        for seed in range(10, 30):  # 80 chunks into a directory of 16
            engine.store(make_tokens(PROMPT, seed), make_kv(PROMPT, seed), cache_salt="flood")
            engine.flush()
        tenants = disk_tenants(engine)
        assert tenants["flood"]["held_bytes"] == 4 * FILE_BYTES  # 25 % of 16 files
        assert tenants["flood"]["quota_evictions"] == 76
        assert tenants["quiet"]["held_bytes"] == 4 * FILE_BYTES
        assert tenants["quiet"]["evictions"] == 0
        cpu = engine.tier("cpu")
        assert isinstance(cpu, CpuTier) and isinstance(cpu.policy, TenantPolicy)
        # a run-time change (what PUT /quota does): saved at once, beside the index
        cpu.policy.quotas.set("flood", TenantLimit(nbytes=2 * FILE_BYTES))
        assert disk_tenants(engine)["flood"]["held_bytes"] == 2 * FILE_BYTES
    with open_engine(tmp_path) as engine:  # the config still says 25 %
        tenants = disk_tenants(engine)
        assert tenants["flood"]["limit_bytes"] == 2 * FILE_BYTES  # the run-time row came back
        assert tenants["flood"]["held_bytes"] == 2 * FILE_BYTES  # and each file's tenant
        assert tenants["quiet"]["held_bytes"] == 4 * FILE_BYTES
        cpu = engine.tier("cpu")
        assert cpu is not None
        cpu.clear()  # only the disk has it now
        with engine.request("r"):
            assert engine.lookup(quiet, "r", cache_salt="quiet").tokens == PROMPT
            assert engine.retrieve(quiet, "r", cache_salt="quiet").equal(make_kv(PROMPT, 1))
        assert engine.check_invariants() == []


def test_a_torn_quota_file_is_ignored_and_quotas_come_from_the_config(tmp_path: Path) -> None:
    with open_engine(tmp_path) as engine:
        engine.store(make_tokens(PROMPT, 1), make_kv(PROMPT, 1), cache_salt="flood")
    (saved,) = tmp_path.glob(".*.tenants")
    saved.write_bytes(saved.read_bytes()[:-7])
    with open_engine(tmp_path) as engine:
        tenants = disk_tenants(engine)
        # the files are all there (the index is its own file); unnamed, they are the
        # unsalted tenant's until rewritten
        assert tenants[""]["held_bytes"] == 4 * FILE_BYTES
        disk = engine.tier("disk")
        assert disk is not None and disk.tenants is not None
        assert {r.tenant: r for r in disk.tenants.rows()}[""].limit_bytes == 8 * FILE_BYTES


def test_salts_under_the_star_row_share_one_disk_quota_and_cannot_shrink_a_named_one(
    tmp_path: Path,
) -> None:
    """A client spraying cache_salts stores under "*" once: alice keeps her 50 % of the
    directory, and all the sprayed salts together hold at most the row's 25 %."""
    with open_engine(tmp_path, tenant_quotas={"alice": "50%", "*": "25%"}) as engine:
        alice = [make_tokens(PROMPT, seed) for seed in (1, 2)]  # 8 files: her 50 % of 16
        for seed, tokens in enumerate(alice, 1):
            engine.store(tokens, make_kv(PROMPT, seed), cache_salt="alice")
        for seed in range(10, 40):  # 30 salts, one prompt each
            engine.store(make_tokens(PROMPT, seed), make_kv(PROMPT, seed), cache_salt=f"s{seed}")
            engine.flush()
        tenants = disk_tenants(engine)
        assert tenants["alice"]["held_bytes"] == 8 * FILE_BYTES
        assert tenants["alice"]["evictions"] == 0
        sprayed = sum(t["held_bytes"] or 0 for name, t in tenants.items() if name != "alice")
        assert sprayed == 4 * FILE_BYTES  # one "*" row for all 30
        assert tenants["s39"]["limit_bytes"] == 4 * FILE_BYTES  # the row each salt shares


def quota_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == quotas.__name__ and r.levelno == logging.WARNING
    ]


def test_one_bad_saved_row_is_dropped_with_a_warning_and_the_others_apply(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A row out of range (1e20 GiB, what LMCache's alias once took and saved) is dropped at
    the next open, named in one warning; it no longer takes the rows set beside it along."""
    with open_engine(tmp_path) as engine:
        engine.store(make_tokens(PROMPT, 1), make_kv(PROMPT, 1), cache_salt="flood")
        cpu = engine.tier("cpu")
        assert isinstance(cpu, CpuTier) and isinstance(cpu.policy, TenantPolicy)
        cpu.policy.quotas.set("flood", TenantLimit(nbytes=2 * FILE_BYTES))
        cpu.policy.quotas.set("huge", TenantLimit(nbytes=int(1e20 * GIB)))  # unchecked, as then
    with caplog.at_level(logging.WARNING, logger=quotas.__name__), open_engine(tmp_path) as engine:
        tenants = disk_tenants(engine)
        assert tenants["flood"]["limit_bytes"] == 2 * FILE_BYTES  # the good row came back
        assert tenants["flood"]["held_bytes"] == 2 * FILE_BYTES  # so did the chunks' tenants
        cpu = engine.tier("cpu")  # the engine's one quota table
        assert isinstance(cpu, CpuTier) and isinstance(cpu.policy, TenantPolicy)
        assert "huge" not in cpu.policy.quotas.rows()
    (warning,) = quota_warnings(caplog)
    assert "saved row 'huge' dropped" in warning and "1 PiB" in warning


def test_a_deeply_nested_quota_file_is_ignored_with_one_warning_and_the_engine_opens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the directory's owner can write the file; a tampered one still must not stop the
    engine: JSON nested past the parser's stack was a RecursionError out of open()."""
    with open_engine(tmp_path) as engine:
        engine.store(make_tokens(PROMPT, 1), make_kv(PROMPT, 1), cache_salt="flood")
    (saved,) = tmp_path.glob(".*.tenants")
    saved.write_bytes(b'{"quotas": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with caplog.at_level(logging.WARNING, logger=quotas.__name__), open_engine(tmp_path) as engine:
        tenants = disk_tenants(engine)
        assert tenants[""]["held_bytes"] == 4 * FILE_BYTES  # files kept, tenants not
        assert tenants[""]["limit_bytes"] == 8 * FILE_BYTES  # the config's "*": 50 %
    (warning,) = quota_warnings(caplog)
    assert "ignored" in warning and "recursion" in warning


def test_pinned_disk_files_stay_and_count_against_their_tenant(tmp_path: Path) -> None:
    first = make_tokens(PROMPT, 1)
    with open_engine(tmp_path) as engine:
        engine.store(first, make_kv(PROMPT, 1), cache_salt="flood")
        engine.flush()
        cpu = engine.tier("cpu")
        assert cpu is not None
        cpu.clear()  # the disk holds the only copy: a lookup pins its files
        with engine.request("reader"):
            assert engine.lookup(first, "reader", cache_salt="flood").tokens == PROMPT
            for seed in range(10, 14):
                tokens = make_tokens(PROMPT, seed)
                engine.store(tokens, make_kv(PROMPT, seed), cache_salt="flood")
                engine.flush()
            tenants = disk_tenants(engine)
            assert tenants["flood"]["held_bytes"] == 4 * FILE_BYTES  # the pinned four
            kv = engine.retrieve(first, "reader", cache_salt="flood")
            assert kv.equal(make_kv(PROMPT, 1))  # served from disk, byte for byte
        engine.store(make_tokens(PROMPT, 20), make_kv(PROMPT, 20), cache_salt="flood")
        engine.flush()
        # unpinned now: the tenant's next store brings it back within its four files
        assert disk_tenants(engine)["flood"]["held_bytes"] == 4 * FILE_BYTES
        assert disk_tenants(engine)["flood"]["quota_evictions"] == 20
        assert engine.check_invariants() == []


# -- the disk index's accounting, as a state machine ----------------------------------------
UNIT = 100  # bytes of one whole chunk's file
TENANTS = ("a", "b", "")


class DiskIndexAccounting(RuleBasedStateMachine):
    """Writes of several tenants into a DiskIndex under quotas (reserve, which evicts by rule
    2 when the directory is full, then commit and the quota's own evictions), pins and their
    release, reads, quota changes. After every step each tenant's bytes equal its indexed
    files times the unit, never negative; after its write lands, a tenant is within its limit
    unless every file held under its row is pinned; used bytes are the indexed files."""

    @initialize()
    def open(self) -> None:
        self.quotas = TenantQuotas({"a": TenantLimit(share=0.25), "*": TenantLimit(share=0.5)})
        self.index = DiskIndex(8 * UNIT)
        self.policy = TenantPolicy(lambda: make_policy("REUSE"), self.quotas, UNIT, 8 * UNIT)
        self.index.policy = self.policy
        self.policy.bind(lambda k: not self.index.is_pinned(k), nullcontext())
        self.owner: dict[ChunkKey, str] = {}
        self.pins: list[ChunkKey] = []
        self.writes = 0

    def next_key(self) -> ChunkKey:
        """Keys from a counter, not random: the policy's order (and so which keys are held
        for the next rule to draw from) must be the same each time hypothesis replays a case."""
        self.writes += 1
        return hashlib.blake2b(self.writes.to_bytes(8, "big"), digest_size=16).digest()

    @rule(tenant=st.sampled_from(TENANTS))
    def write(self, tenant: str) -> None:
        key = self.next_key()
        self.policy.expect(key, tenant)
        if self.index.reserve(UNIT) is None:
            self.policy.forget_expected(key)
            return  # full of pinned files: dropped
        self.index.commit(key, DiskEntry(16, UNIT))
        self.owner[key] = tenant
        self.index.forget(self.policy.charge(key, tenant))  # as DiskQuotas.charge
        self.check_within_limit(tenant)

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        held = sorted(k for k in self.owner if k in self.index)
        if held:
            key = data.draw(st.sampled_from(held))
            assert self.index.pin(key)
            self.pins.append(key)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        if self.pins:
            key = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
            self.index.unpin(key)

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        held = sorted(k for k in self.owner if k in self.index)
        if held:
            self.index.touch([data.draw(st.sampled_from(held))])

    @rule(
        tenant=st.sampled_from(TENANTS),
        limit=st.one_of(st.none(), st.integers(1, 8).map(lambda n: TenantLimit(share=n / 8))),
    )
    def set_quota(self, tenant: str, limit: TenantLimit | None) -> None:
        self.quotas.set(tenant, limit)
        self.index.forget(self.policy.regroup())
        for each in TENANTS:
            self.check_within_limit(each)

    def check_within_limit(self, tenant: str) -> None:
        """``tenant``'s row (its own, or "*" shared by every unnamed salt) within its limit."""
        limit = self.policy.limit_bytes(tenant)
        row_of = self.quotas.row_of
        sharing = {t for t in TENANTS if row_of(t) == row_of(tenant)}
        if limit is not None and sum(map(self.policy.held_bytes, sharing)) > limit:
            held = {k for k, t in self.owner.items() if t in sharing and k in self.index}
            assert held <= set(self.pins), f"{tenant!r}'s row over its limit, unpinned files"

    @invariant()
    def bytes_held_equal_the_files_indexed(self) -> None:
        if not hasattr(self, "index"):
            return
        for tenant in TENANTS:
            files_held = sum(1 for k, t in self.owner.items() if t == tenant and k in self.index)
            assert self.policy.held_bytes(tenant) == files_held * UNIT >= 0
        assert self.index.used_bytes == len(self.index) * UNIT
        assert len(self.policy) == len(self.index)
        assert self.index.used_bytes + self.index.reserved_bytes <= 8 * UNIT


TestDiskIndexAccounting = DiskIndexAccounting.TestCase
TestDiskIndexAccounting.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class TestDiskTenantContract(TenantContract):
    unit_bytes = RECORD_BYTES  # one chunk's file: header and payload

    @pytest.fixture
    def tenant_tier(self, tmp_path: Path) -> Iterator[TenantTierFactory]:
        made: list[DiskTier] = []

        def make(quotas: TenantQuotas) -> DiskTier:
            tier = make_tier(tmp_path / str(len(made)), capacity_records=16)
            tier.attach_quotas(quotas)
            tier.open()
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()
