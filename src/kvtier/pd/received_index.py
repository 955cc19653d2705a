"""Which chunk each page of the PD receive buffer holds: key -> entry, and page -> key.

The index owns no page reference (:mod:`kvtier.pd.buffer` has the ownership table): an entry
is made when a reservation takes a fresh page for a key, becomes visible to lookups once its
bytes are verified (``ready``), and goes when the chunk is dropped (corrupt, removed, never
filled) or its page's last reference does. A page can be reused for another key while an old
reservation still names it, so every lookup by page checks that the entry is still that
page's (``entry.page == page``). Not thread-safe on its own: the buffer calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey


@dataclass(slots=True)
class Entry:
    page: int
    num_tokens: int
    checksum: int = 0
    ready: bool = False  # verified and visible to lookups


class ReceivedIndex:
    def __init__(self) -> None:
        self._entries: dict[ChunkKey, Entry] = {}
        self._page_key: dict[int, ChunkKey] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: ChunkKey) -> Entry | None:
        return self._entries.get(key)

    def __getitem__(self, key: ChunkKey) -> Entry:
        return self._entries[key]

    def items(self) -> Iterator[tuple[ChunkKey, Entry]]:
        return iter(list(self._entries.items()))

    def ready(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def split(self, keys: Sequence[ChunkKey]) -> tuple[list[int], list[int]]:
        """Positions of ``keys`` the buffer holds (received or on their way), and the rest."""
        held = [i for i, k in enumerate(keys) if k in self._entries]
        return held, [i for i, k in enumerate(keys) if k not in self._entries]

    def add(self, key: ChunkKey, page: int, num_tokens: int) -> None:
        """``key`` will arrive in ``page`` (a fresh page a reservation holds)."""
        self._entries[key] = Entry(page, num_tokens)
        self._page_key[page] = key

    def drop(self, key: ChunkKey) -> None:
        """Nobody may find ``key`` any more (its page goes back with its references)."""
        del self._entries[key]

    def drop_unfilled(self, new: Mapping[int, ChunkKey]) -> None:
        """A reservation ended: the chunks it waited for and never received are dropped."""
        for page, key in new.items():
            entry = self._entries.get(key)
            if entry is not None and entry.page == page and not entry.ready:
                del self._entries[key]

    def forget_free(self, pages: Sequence[int], refcount: Callable[[int], int]) -> None:
        """Of ``pages`` just given back, drop the entry of each that became free."""
        for page in pages:
            if refcount(page) == 0:
                key = self._page_key.pop(page, None)
                entry = self._entries.get(key) if key is not None else None
                if key is not None and entry is not None and entry.page == page:
                    del self._entries[key]

    def received(self, new: Mapping[int, ChunkKey]) -> int:
        """How many of a reservation's awaited chunks (page -> key) arrived, verified."""
        count = 0
        for page, key in new.items():
            entry = self._entries.get(key)
            count += entry is not None and entry.page == page and entry.ready
        return count

    def on_free_pages(self, refs: Sequence[int]) -> list[str]:
        """Problems as sentences: entries whose page has no reference (``refs`` by page)."""
        return [
            f"index entry {key.hex()} on free page {entry.page}"
            for key, entry in self._entries.items()
            if refs[entry.page] == 0
        ]

    def clear(self) -> None:
        self._entries.clear()
        self._page_key.clear()
