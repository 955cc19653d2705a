"""Repeated warnings (a full disk, Redis at maxmemory, a lookup channel that is down) are one
line per interval with a count, not one line per event."""

from __future__ import annotations

import logging
import time

import pytest

from kvtier.repeated_log import RepeatedLog


def test_a_burst_is_one_line_then_one_line_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("kvtier.test.repeated")
    repeated = RepeatedLog(logger, interval=0.3)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for i in range(300):
            repeated.warning(("write", 28), "disk write of chunk %d failed", i)
        repeated.warning("other", "another reason is its own line")
        assert repeated.held(("write", 28)) == 299
        time.sleep(0.35)
        repeated.warning(("write", 28), "disk write of chunk %d failed", 300)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "disk write of chunk 0 failed",
        "another reason is its own line",
        "disk write of chunk 300 failed (and 299 more like it in the last 0.3 s)",
    ]
