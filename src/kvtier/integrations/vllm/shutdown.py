"""The one line a vLLM worker logs as vLLM shuts it down: what kvtier flushed, dropped and
saved, so that an operator knows what the next start will find.

Taken around the cache's close (``Engine.close`` drains each lower tier's queued writes for
up to ``blocking_timeout_secs``, then closes the tiers)::

    before = ShutdownTally.of(engine)     still open: each lower tier's counters, read now
    engine.close()                        queued disk / Redis writes land, or are dropped
    before.line(rank, seconds)            the same counters read again: the difference

``flushed``: writes that landed during the close (they were queued when vLLM stopped);
``dropped``: writes given up during it (failed, or still queued when the drain timed out);
``saved``: what each lower tier stored over the whole run, which outlives vLLM (disk after a
restart, Redis for the fleet); the CPU tier's chunks are the worker's memory and go with it.
With vLLM's default ``--shutdown-timeout 0`` the worker may be torn down before any of this
runs, and no line is logged: the docs' commands set 30.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.engine import Engine, EngineState
from kvtier.storage.base import Tier, TierCounters


@dataclass(frozen=True, slots=True)
class _Counts:
    stored: int
    lost: int  # dropped or failed

    @classmethod
    def of(cls, counters: TierCounters) -> _Counts:
        return cls(counters.stored, counters.dropped + counters.failed)


@dataclass(frozen=True, slots=True)
class ShutdownTally:
    """The cache's write counters just before its close (see the module docstring)."""

    tiers: tuple[tuple[Tier, _Counts], ...]  # each lower tier, with its counts before close
    cpu_chunks: int  # chunks stored into the CPU tier over the run

    @classmethod
    def of(cls, engine: Engine) -> ShutdownTally | None:
        """None when there is nothing to report (the engine is not open)."""
        if engine.state is not EngineState.OPEN:
            return None
        lower = [tier for tier in engine.tiers() if tier.name != "cpu"]
        stored = engine.stats()["stored_chunks"]
        return cls(tuple((t, _Counts.of(t.counters)) for t in lower), int(stored))

    def line(self, rank: int, seconds: float) -> str:
        """The shutdown line, from the counters read again after the close."""
        flushed: list[str] = []
        dropped: list[str] = []
        saved: list[str] = []
        for tier, before in self.tiers:
            after = _Counts.of(tier.counters)
            flushed.append(f"{tier.name} {after.stored - before.stored:,}")
            dropped.append(f"{tier.name} {after.lost - before.lost:,}")
            saved.append(f"{tier.name} {after.stored:,}")
        if not self.tiers:
            return (
                f"kvtier worker {rank} shut down in {seconds:.1f} s: no disk or remote tier, "
                f"nothing to flush; the CPU tier's {self.cpu_chunks:,} stored chunks go with "
                "the process"
            )
        return (
            f"kvtier worker {rank} shut down in {seconds:.1f} s: flushed the writes queued at "
            f"stop ({', '.join(flushed)} chunks), dropped ({', '.join(dropped)}); saved over "
            f"this run ({', '.join(saved)} chunks), which outlive vLLM; the CPU tier's "
            f"{self.cpu_chunks:,} stored chunks go with the process"
        )


def server_line(rank: int, where: str) -> str:
    """The shutdown line of a worker whose cache is the host's ``kvtier server``."""
    return (
        f"kvtier worker {rank} shut down: its cache is the kvtier server at {where}, which "
        "keeps every chunk (nothing to flush here); this worker's pins were released"
    )
