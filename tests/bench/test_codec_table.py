"""``kvtier bench codec`` prints the table docs/codecs.md shows (issue 50, item 9), with the
quality gate's verdict in a last column; ``--json`` keeps the whole result."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.bench.codec_table import HEADER, format_text
from kvtier.cli.main import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "codecs.md"


def test_the_text_output_is_the_docs_table_row_for_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codec", "--no-gate", "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    doc_header = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("| dtype |"))
    assert HEADER[0].startswith(doc_header.removesuffix("|"))  # the doc's columns, then the gate
    rows = [ln.split("|")[1:-1] for ln in text.splitlines() if ln.startswith("| ")][1:]
    names = [(cells[0].strip(), cells[1].strip()) for cells in rows]
    assert names == [
        ("bf16", "memcpy"), ("", "identity"), ("", "lossless"), ("", "fp8"), ("", "int8"),
        ("fp32", "memcpy"), ("", "identity"), ("", "lossless"), ("", "fp8"), ("", "int8"),
    ]  # fmt: skip
    by_codec = {cells[1].strip(): cells for cells in rows[5:]}  # fp32's rows
    assert by_codec["identity"][3].strip() == "(a view)"
    assert by_codec["lossless"][5].strip() == "exact"
    assert re.fullmatch(r" \d\.\d\d % / \d\.\d\d % ", by_codec["int8"][5])
    assert float(by_codec["int8"][2]) > 3.8  # fp32 to int8 and its scales


def test_a_gated_codec_shows_its_verdict() -> None:
    gate = {"passed": True, "greedy_agreement": 0.9985, "accuracy": 0.5, "recompute_accuracy": 0.5}
    row = {
        "lossless": False,
        "ratio": 1.94,
        "encode_gbps": 1.0,
        "decode_gbps": 2.0,
        "key_rel_error": 0.023,
        "value_rel_error": 0.0258,
        "gate": gate,
    }
    result = {"threads": 1, "tokens": 256, "bf16": {"memcpy_gbps": 14.0, "codecs": {"fp8": row}}}
    text = format_text(result)
    assert "| | fp8 | 1.94 | 1.00 | 2.00 | 2.30 % / 2.58 % | pass: agreement 0.9985" in text
