"""A peer's words on their way into a log line: escaped and bounded.

Anything a peer sent (its announced identity, a reason it gives, a transfer id, an object
name) can hold a newline that forges a log line, a terminal escape, or a megabyte. Every
such string goes through :func:`peer_text` before it is formatted into a message.
"""

from __future__ import annotations

MAX_CHARS = 160


def peer_text(value: object, limit: int = MAX_CHARS) -> str:
    """``value`` as printable ASCII (``\\n``, ``\\x1b``, ``\\u2028`` escaped), cut to
    ``limit`` characters with a note of how much was left out."""
    text = value if isinstance(value, str) else repr(value)
    head = text[: limit + 1].encode("unicode_escape").decode("ascii")
    if len(head) <= limit and len(text) <= limit:
        return head
    return f"{head[:limit]}...({len(text)} characters)"
