"""kvtier's log lines inside a host process (vLLM), and the per-request summary line.

Inside vLLM, kvtier's loggers (``kvtier.*``) have no handler of their own: vLLM configures
only its ``vllm`` logger, so kvtier's INFO lines vanished and its warnings reached stderr
through Python's last-resort handler, with no time, level or process. :func:`join_host_logging`
hands kvtier's records to the host's handlers, so they carry vLLM's prefix (process role and
pid, level, time, file:line), at the level ``KVTIER_LOG_LEVEL`` names (INFO by default).
A WARNING or worse repeated (same logger, same message template) within
:data:`REPEAT_WINDOW_S` is dropped and counted; the next one that passes says how many were.

When a request ends, :func:`log_request_end` writes what happened to it (its lease's
:class:`~kvtier.lease.RequestRecord`) as one INFO line on ``kvtier.requests``::

    request cmpl-7-0: 1408 prompt tokens, loaded 1024 from kvtier (cpu 768, disk 256),
    found 1280 (256 not needed: the engine had them), stored 256 new

Set ``KVTIER_LOG_LEVEL=WARNING`` (or the ``kvtier.requests`` logger's level) to turn the
per-request lines off.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvtier.lease import RequestRecord

REPEAT_WINDOW_S = 60.0
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

request_log = logging.getLogger("kvtier.requests")
_joined: set[str] = set()
_join_lock = threading.Lock()


def level_from_env(default: str = "INFO") -> int:
    """``KVTIER_LOG_LEVEL`` as a logging level; an unknown name falls back to ``default``."""
    name = os.environ.get("KVTIER_LOG_LEVEL", default).strip().upper()
    return logging.getLevelName(name if name in LEVELS else default)  # type: ignore[no-any-return]


class RateLimited(logging.Handler):
    """Forwards records to ``inner``; a WARNING+ record like one forwarded less than
    ``window_s`` ago is dropped and counted, and the next one forwarded says how many."""

    def __init__(self, inner: logging.Handler, window_s: float = REPEAT_WINDOW_S) -> None:
        super().__init__(level=logging.NOTSET)
        self.inner = inner
        self.window_s = window_s
        self._last: dict[tuple[str, int, str], tuple[float, int]] = {}
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            key = (record.name, record.levelno, str(record.msg))
            now = time.monotonic()
            with self._guard:
                last, dropped = self._last.get(key, (-float("inf"), 0))
                if now - last < self.window_s:
                    self._last[key] = (last, dropped + 1)
                    return
                self._last[key] = (now, 0)
                if len(self._last) > 10_000:
                    self._last.clear()
            if dropped:
                record.msg = (
                    f"{record.msg} ({dropped} more like this in the last {self.window_s:.0f} s)"
                )
        if record.levelno >= self.inner.level:
            self.inner.handle(record)


def join_host_logging(host: str = "vllm", *, level: int | None = None) -> bool:
    """Send ``kvtier.*`` records to the handlers of the host's logger ``host`` (once per
    process). False when the host has no handlers (kvtier's logging is left alone)."""
    with _join_lock:
        if host in _joined:
            return True
        handlers = logging.getLogger(host).handlers
        if not handlers:
            return False
        kvtier = logging.getLogger("kvtier")
        for handler in handlers:
            kvtier.addHandler(RateLimited(handler))
        kvtier.setLevel(level_from_env() if level is None else level)
        kvtier.propagate = False  # one copy of each line, through the host's format
        _joined.add(host)
        return True


def log_request_end(request_id: str, record: RequestRecord) -> str | None:
    """Write (and return) the request's line; None when nothing was recorded for it (a
    lease that only held a store's pages) or the line is off."""
    if not record.noted or not request_log.isEnabledFor(logging.INFO):
        return None
    line = describe(request_id, record)
    request_log.info("%s", line)
    return line


def describe(request_id: str, record: RequestRecord) -> str:
    parts = [f"request {request_id}: {record.prompt_tokens} prompt tokens"]
    if record.loaded:
        tiers = ", ".join(f"{t} {n}" for t, n in sorted(record.loaded_by_tier.items()))
        parts.append(f"loaded {record.loaded} tokens from kvtier ({tiers})")
    else:
        parts.append("loaded 0 tokens from kvtier")
    if record.unused:
        parts.append(f"found {record.found} ({record.unused} not needed: the engine had them)")
    if record.stored:
        parts.append(f"stored {record.stored} new")
    return ", ".join(parts)
