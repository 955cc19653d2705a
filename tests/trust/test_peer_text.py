"""A peer's words reach a log escaped and bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.trust.peer_text import MAX_CHARS, peer_text


def test_a_newline_cannot_forge_a_log_line() -> None:
    text = peer_text("node\nCRITICAL kvtier: all keys leaked\x1b[2J")
    assert "\n" not in text and "\x1b" not in text
    assert text.startswith("node\\nCRITICAL")


def test_a_megabyte_is_cut_and_says_how_long_it_was() -> None:
    text = peer_text("x" * (1 << 20))
    assert len(text) < MAX_CHARS + 40 and "(1048576 characters)" in text


@given(st.text(max_size=400) | st.binary(max_size=400))
def test_always_printable_ascii_and_bounded(value: str | bytes) -> None:
    text = peer_text(value)
    assert text.isascii() and text.isprintable()
    assert len(text) <= MAX_CHARS + 40
