"""A bench's checks of what it measured: kept under ``python -O`` (which drops ``assert``), so a
figure over the wrong bytes or the wrong hit count never comes out as a result."""

from __future__ import annotations


def require(condition: bool, problem: str) -> None:
    """Raise ``AssertionError(problem)`` unless ``condition`` (the bench then exits non-zero)."""
    if not condition:
        raise AssertionError(problem)
