"""What a lookup found: :class:`Hit`, the one answer from the cache to vLLM's scheduler.

It is made once, where the plan is read, and travels as-is (a msgspec struct, tagged, so it is
a message of both local wires)::

    Engine.lookup ─▶ Hit ─┬─▶ caller in process (KVCache.lookup)
                          ├─▶ server socket (kvtier.server.protocol) ─▶ ServerClient.lookup
                          └─▶ vLLM lookup channel (...vllm.rpc) ─▶ the scheduler side

    prompt     |------------------------------------------|
    tokens     |===================================|          the hit, pinned for the request
    cpu_tokens |==============|                               from token 0: no lower tier read

``0 <= cpu_tokens <= tokens`` holds for every ``Hit``: it is checked when one is made, also
when one is decoded from a peer's frame (there a bad one is a malformed message).
"""

from __future__ import annotations

import msgspec

from kvtier.errors import InputError


class Hit(msgspec.Struct, tag=True, frozen=True):
    """The hit ``tokens`` (the longest cached prefix, pinned for the request), and
    ``cpu_tokens``: how many of them, from token 0, are in the CPU tier or held by the caller
    (the skip). Those load without reading disk, Redis or PD, so a connector loads them in
    the step and the rest in the background."""

    tokens: int
    cpu_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.cpu_tokens <= self.tokens:
            raise InputError(
                f"a Hit needs 0 <= cpu_tokens <= tokens, got tokens={self.tokens}, "
                f"cpu_tokens={self.cpu_tokens}"
            )
