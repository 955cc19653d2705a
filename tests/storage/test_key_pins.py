"""KeyPins: each unpin gives back the page its pin took, once."""

from __future__ import annotations

from kvtier.storage.key_pins import KeyPins


def test_take_returns_each_pinned_page_once() -> None:
    pins = KeyPins()
    pins.record(b"k", 3)
    pins.record(b"k", 5)  # the entry moved to another page between two pins
    assert b"k" in pins and pins.references_to(3) == 1 and pins.references_to(5) == 1
    assert sorted([pins.take(b"k"), pins.take(b"k")]) == [3, 5]  # type: ignore[type-var]
    assert pins.take(b"k") is None  # a third unpin is a no-op, never a second release
    assert b"k" not in pins and pins.references_to(3) == 0


def test_unknown_key_has_no_pin() -> None:
    assert KeyPins().take(b"never") is None
