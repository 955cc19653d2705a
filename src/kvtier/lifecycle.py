"""The lifecycle every long-lived kvtier object follows: constructed (nothing started),
open (threads, connections and memory live), closed (everything released; use raises)."""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"
