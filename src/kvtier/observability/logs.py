"""kvtier's log lines inside a host process (vLLM), and the per-request summary line.

Inside vLLM, kvtier's loggers (``kvtier.*``) have no handler of their own: vLLM configures
only its ``vllm`` logger, so kvtier's INFO lines vanished and its warnings reached stderr
through Python's last-resort handler, with no time, level or process. :func:`join_host_logging`
hands kvtier's records to the host's handlers, so they carry vLLM's prefix (process role and
pid, level, time, file:line), at the level ``KVTIER_LOG_LEVEL`` names (INFO by default).
A WARNING or worse repeated (same logger, same message template) within
:data:`REPEAT_WINDOW_S` is dropped and counted; the next one that passes says how many were.

:class:`RequestLog` (one per process, :data:`REQUESTS`) gathers what happened to a request and
writes one INFO line on ``kvtier.requests`` when it ends::

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
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

REPEAT_WINDOW_S = 60.0
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_OPEN_REQUESTS = 100_000  # a request whose end never comes is forgotten, oldest first

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


@dataclass
class _Request:
    prompt_tokens: int = 0
    found: int = 0
    loaded: int = 0
    loaded_by_tier: dict[str, int] = field(default_factory=dict)
    stored: int = 0


class RequestLog:
    """What happened to each open request, written as one line when it ends (see module)."""

    def __init__(self, logger: logging.Logger = request_log) -> None:
        self.logger = logger
        self._open: OrderedDict[str, _Request] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, request_id: str) -> _Request:
        entry = self._open.get(request_id)
        if entry is None:
            entry = self._open[request_id] = _Request()
            while len(self._open) > MAX_OPEN_REQUESTS:
                self._open.popitem(last=False)
        return entry

    def found(self, request_id: str, prompt_tokens: int, tokens: int) -> None:
        with self._lock:
            entry = self._get(request_id)
            entry.prompt_tokens, entry.found = prompt_tokens, tokens

    def loaded(self, request_id: str, by_tier: Mapping[str, int]) -> None:
        with self._lock:
            entry = self._get(request_id)
            for tier, n in by_tier.items():
                if n > 0:
                    entry.loaded += n
                    entry.loaded_by_tier[tier] = entry.loaded_by_tier.get(tier, 0) + n

    def stored(self, request_id: str, tokens: int, prompt_tokens: int) -> None:
        """``tokens`` of ``request_id``'s prompt newly stored (a connector that knows the
        request says so; an Engine's store has no request id)."""
        with self._lock:
            entry = self._get(request_id)
            entry.stored += tokens
            entry.prompt_tokens = max(entry.prompt_tokens, prompt_tokens)

    def end(self, request_id: str) -> str | None:
        """Write (and return) the request's line; None when nothing was recorded for it."""
        with self._lock:
            entry = self._open.pop(request_id, None)
        if entry is None or not self.logger.isEnabledFor(logging.INFO):
            return None
        line = describe(request_id, entry)
        self.logger.info("%s", line)
        return line


def describe(request_id: str, entry: _Request) -> str:
    parts = [f"request {request_id}: {entry.prompt_tokens} prompt tokens"]
    if entry.loaded:
        tiers = ", ".join(f"{t} {n}" for t, n in sorted(entry.loaded_by_tier.items()))
        parts.append(f"loaded {entry.loaded} tokens from kvtier ({tiers})")
    else:
        parts.append("loaded 0 tokens from kvtier")
    unused = max(0, entry.found - entry.loaded)
    if unused:
        parts.append(f"found {entry.found} ({unused} not needed: the engine had them)")
    if entry.stored:
        parts.append(f"stored {entry.stored} new")
    return ", ".join(parts)


REQUESTS = RequestLog()
