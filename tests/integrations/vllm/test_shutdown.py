"""The worker's shutdown line: what the cache's close flushed, dropped and saved, read from
a real engine's tiers around its close (a disk tier with writes still queued)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.integrations.vllm.shutdown import ShutdownTally, server_line
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def _engine(tmp_path: Path, **keys: object) -> Engine:
    config = Config.load(env={}, overrides={"chunk_size": 16, "max_local_cpu_size": "8MiB", **keys})
    return Engine(config, LAYOUT, model_name="shutdown").open()


def test_the_line_counts_what_the_close_flushed_and_what_the_run_saved(tmp_path: Path) -> None:
    engine = _engine(tmp_path, local_disk=str(tmp_path / "disk"), max_local_disk_size="8MiB")
    tokens = list(range(128))
    engine.store(tokens, torch.randn(2, 2, 128, 32))  # 8 chunks; disk writes queued
    tally = ShutdownTally.of(engine)
    assert tally is not None
    disk = engine.tier("disk")
    assert disk is not None
    queued = 8 - disk.counters.stored - disk.counters.dropped - disk.counters.failed
    engine.close()
    line = tally.line(0, 0.5)
    assert line.startswith("kvtier worker 0 shut down in 0.5 s: ")
    flushed = re.search(r"flushed the writes queued at stop \(disk ([\d,]+) chunks\)", line)
    dropped = re.search(r"dropped \(disk ([\d,]+)\)", line)
    saved = re.search(r"saved over this run \(disk ([\d,]+) chunks\)", line)
    assert flushed and dropped and saved, line
    assert int(flushed[1]) + int(dropped[1]) == queued  # every queued write is accounted
    assert int(saved[1]) == disk.counters.stored == 8 - int(dropped[1])
    assert "CPU tier's 8 stored chunks go with the process" in line
    # and the disk keeps them for the next start
    again = _engine(tmp_path, local_disk=str(tmp_path / "disk"), max_local_disk_size="8MiB")
    try:
        assert again.lookup(tokens, "r").tokens == 16 * int(saved[1])
        again.end_request("r")
    finally:
        again.close()


def test_a_closed_engine_has_nothing_to_report_and_a_cpu_only_one_says_so(
    tmp_path: Path,
) -> None:
    engine = _engine(tmp_path)
    engine.store(list(range(32)), torch.randn(2, 2, 32, 32))
    tally = ShutdownTally.of(engine)
    engine.close()
    assert tally is not None and ShutdownTally.of(engine) is None
    assert "no disk or remote tier, nothing to flush" in tally.line(1, 0.0)
    assert "2 stored chunks" in tally.line(1, 0.0)
    assert "kvtier server at unix:///s.sock" in server_line(0, "unix:///s.sock")
