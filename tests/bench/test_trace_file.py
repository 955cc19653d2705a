"""The trace shipped with kvtier: found by name, packaged with its license, and a trace that
is not there is one ``kvtier: error:`` line, not a traceback."""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import tomllib
from pathlib import Path

import pytest

from kvtier.bench import sliding, trace
from kvtier.bench.trace_file import (
    DEFAULT,
    SHIPPED,
    TRACES_DIR,
    TraceFormatError,
    load,
    resolve,
)
from kvtier.cli.main import main
from kvtier.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
# traces/README.md's numbers for the file as published (Mooncake, FAST'25).
CONVERSATION_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def test_the_conversation_trace_is_shipped_unchanged_with_its_license() -> None:
    path = resolve("conversation")
    assert path.parent == TRACES_DIR
    assert hashlib.sha256(path.read_bytes()).hexdigest() == CONVERSATION_SHA256
    assert "Apache License" in (TRACES_DIR / "LICENSE-APACHE.mooncake").read_text()
    assert "kvcache-ai/Mooncake" in (TRACES_DIR / "README.md").read_text()
    loaded = load("conversation")
    assert len(loaded.requests) == 12_031 and loaded.unique_blocks() == 182_790


def test_the_package_data_carries_every_shipped_file() -> None:
    """An installed kvtier (a wheel, not this checkout) must find the trace and its license."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["kvtier"]
    package = ROOT / "src" / "kvtier"
    for file in TRACES_DIR.iterdir():
        relative = str(file.relative_to(package))
        assert any(fnmatch.fnmatch(relative, g) for g in globs), relative


@pytest.mark.parametrize("bench", [trace, sliding])
def test_the_trace_benches_default_to_the_shipped_trace(bench: object) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)  # type: ignore[attr-defined]
    assert parser.parse_args([]).path == DEFAULT and DEFAULT in SHIPPED
    assert parser.parse_args(["conversation"]).path == "conversation"


def test_a_missing_trace_is_an_input_error_naming_it_and_the_shipped_ones(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"'.*nope\.jsonl' does not exist.*conversation"):
        load(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="is not a file"):
        load(tmp_path)


def test_a_line_that_is_no_json_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 4, "hash_ids": [1]}\nnot json\n')
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not a JSON object"):
        load(path, block_tokens=4)


@pytest.mark.parametrize("bench", ["trace", "sliding"])
def test_kvtier_bench_on_a_missing_trace_prints_one_error_line(
    bench: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nope.jsonl")
    assert main(["bench", bench, missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier: error: trace {missing!r} does not exist")
    assert "Traceback" not in err and len(err.splitlines()) == 1
