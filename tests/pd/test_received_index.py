"""The receive buffer's index (kvtier.pd.received_index): an entry is forgotten only through
the page it names, so a page given back and reused for another key, or a key received again
into another page, never loses the newer entry to the older page's end."""

from __future__ import annotations

from kvtier.pd.received_index import ReceivedIndex


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_split_add_and_ready() -> None:
    index = ReceivedIndex()
    index.add(key(1), page=0, num_tokens=16)
    assert index.split([key(0), key(1), key(2)]) == ([1], [0, 2])
    assert not index.ready(key(1)) and index.received({0: key(1)}) == 0
    index[key(1)].ready = True
    assert index.ready(key(1)) and index.received({0: key(1)}) == 1


def test_an_older_pages_end_never_drops_the_newer_entry_of_its_key() -> None:
    index = ReceivedIndex()
    index.add(key(1), page=0, num_tokens=16)
    index.drop(key(1))  # corrupt: dropped while page 0 is still held
    index.add(key(1), page=3, num_tokens=16)  # received again, into page 3
    index.drop_unfilled({0: key(1)})  # the first reservation ends: page 0 is not key 1's now
    index.forget_free([0], refcount=lambda page: 0)
    assert key(1) in index and index[key(1)].page == 3
    index.forget_free([3], refcount=lambda page: 1)  # still held: kept
    assert key(1) in index
    index.forget_free([3], refcount=lambda page: 0)
    assert key(1) not in index and len(index) == 0


def test_entries_on_free_pages_are_reported() -> None:
    index = ReceivedIndex()
    index.add(key(7), page=2, num_tokens=16)
    assert index.on_free_pages([1, 1, 0]) == [f"index entry {key(7).hex()} on free page 2"]
    assert index.on_free_pages([1, 1, 1]) == []
