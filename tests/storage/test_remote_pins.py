"""A remote tier's pins only count: any run of pins and unpins leaves pinned exactly the keys
with more pins than unpins since their count last reached zero, never below zero."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.storage.remote.pins import PinCounts

KEYS = [bytes([n]) * 16 for n in range(4)]


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(KEYS), st.integers(1, 3)), max_size=40))
def test_pins_count_and_a_stray_unpin_changes_nothing(steps: list[tuple[bool, bytes, int]]) -> None:
    pins = PinCounts()
    expected: dict[bytes, int] = {}
    for is_pin, key, times in steps:
        batch = [key] * times
        if is_pin:
            assert pins.pin_many(batch) == times  # a shared store answers every key usable
            expected[key] = expected.get(key, 0) + times
        else:
            pins.unpin_many(batch)
            expected[key] = max(0, expected.get(key, 0) - times)
        assert pins.pinned() == {k for k, n in expected.items() if n > 0}


def test_single_pin_and_unpin() -> None:
    pins = PinCounts()
    assert pins.pin(KEYS[0]) and pins.pin(KEYS[0])
    pins.unpin(KEYS[0])
    assert pins.pinned() == {KEYS[0]}
    pins.unpin(KEYS[0])
    pins.unpin(KEYS[0])  # one more than pinned: no-op
    assert pins.pinned() == set()
