"""Each configuration of ``python -m benchmarks serve`` starts vLLM as the table in
benchmarks/serve.py says (benchmarks.serve_plans)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.serve_plans import CONFIGS, plan_for


def test_each_configuration_starts_vllm_as_documented(tmp_path: Path) -> None:
    plans = {
        name: plan_for(name, tmp_path, "1GiB", "redis://127.0.0.1:1", "/tmp/s.sock")
        for name in CONFIGS
    }
    assert plans["none"].transfer is None and not plans["none"].prefix_cache
    assert plans["apc"].transfer is None and plans["apc"].prefix_cache
    for name in ("cpu", "disk", "redis", "server", "example"):
        assert not plans[name].prefix_cache  # reuse is the connector's alone
        assert plans[name].transfer is not None
    extra = {n: p.transfer["kv_connector_extra_config"] for n, p in plans.items() if p.transfer}
    assert extra["cpu"] == {"max_local_cpu_size": "1GiB"}
    assert extra["disk"]["local_cpu"] is False and extra["disk"]["local_disk"].endswith("disk")
    assert extra["redis"]["remote_url"] == "redis://127.0.0.1:1"
    assert extra["server"] == {"server": "unix:///tmp/s.sock"}
    assert plans["example"].transfer["kv_connector"] == "ExampleConnector"  # type: ignore[index]
    assert {n for n, p in plans.items() if p.fresh} == {"disk", "redis", "server"}
    with pytest.raises(ValueError, match="unknown"):
        plan_for("gpu", tmp_path, "1GiB")
    chunked = plan_for("disk", tmp_path, "1GiB", chunk_size=128).transfer
    assert chunked is not None and chunked["kv_connector_extra_config"]["chunk_size"] == 128
    answers = plan_for("cpu", tmp_path, "1GiB", save_decode_cache=False).transfer
    assert answers is not None
    assert answers["kv_connector_extra_config"]["save_decode_cache"] is False
    for name, key in (("disk", "disk_codec"), ("redis", "remote_codec")):
        coded = plan_for(name, tmp_path, "1GiB", codec="fp8").transfer
        assert coded is not None and coded["kv_connector_extra_config"][key] == "fp8"
    plain = plan_for("cpu", tmp_path, "1GiB", codec="fp8").transfer
    assert plain is not None and "disk_codec" not in plain["kv_connector_extra_config"]
