"""What a worker serves on its lookup channel (:class:`~.rpc.LookupHandler`): the
scheduler's lookups, ends and (a PD decoder's) pulls, and an operator's or a test's probes,
each one call into the worker's cache."""

from __future__ import annotations

from typing import Any, Protocol

from kvtier.cache import KVCache
from kvtier.engine import Engine
from kvtier.errors import StateError
from kvtier.hit import Hit
from kvtier.integrations.vllm.pd import DecoderPulls, PDEndpoint
from kvtier.integrations.vllm.rpc import Leak, PullFrom
from kvtier.integrations.vllm.states import PagedState
from kvtier.request_salt import RequestSalt


class ServedWorker(Protocol):
    """The parts of :class:`~.worker.WorkerSide` the channel calls into."""

    engine: Engine | None
    server: str | None
    pulls: DecoderPulls | None
    states: PagedState | None
    checkpoint_unit: int
    _pd: PDEndpoint | None

    def _parts(self) -> tuple[KVCache, Any]: ...

    def stats(self) -> dict[str, int]: ...


class WorkerChannel:
    """What the worker serves on its lookup channel (:class:`~.rpc.LookupHandler`): the
    scheduler's lookups and ends, and an operator's or a test's probes, each one call into
    the worker's cache."""

    def __init__(self, worker: ServedWorker) -> None:
        self._worker = worker

    def lookup(self, request_id: str, tokens: list[int], cache_salt: RequestSalt | None) -> Hit:
        # A state model's hit, or a sliding model's with large chunks, may end at an earlier
        # prompt's checkpoint, a block boundary inside the chunk the lookup misses
        # (kvtier.engine._checkpoints).
        states = self._worker.states
        unit = states.block_size if states is not None else self._worker.checkpoint_unit
        return self._cache().lookup(  # the Hit is sent as is
            tokens, request_id, cache_salt=cache_salt, checkpoint_tokens=unit
        )

    def end(self, request_id: str) -> bool:
        if self._worker.pulls is not None:
            self._worker.pulls.forget(request_id)
        return self._cache().end_request(request_id)  # during a load: released when it is done

    def pull(self, pull: PullFrom) -> bool:
        pulls = self._worker.pulls
        if pulls is None:
            raise StateError("this kvtier worker is not a PD decoder (pd_role receiver)")
        return pulls.poll(pull.request_id, pull.tokens, pull.cache_salt, pull.host, pull.port)

    def stats(self) -> dict[str, Any]:
        stats = self._cache().stats()
        pd = self._worker._pd
        source = pd.stats() if pd is not None else None
        if source is not None:
            stats["pd_source"] = source  # where decoders pull from (xPyD), and its buffer
        if self._worker.pulls is not None:
            stats["pd_pulls"] = self._worker.pulls.stats()  # a decoder's (xPyD)
        stats["worker"] = self._worker.stats()  # its scratch, its layer-wise loads
        return stats

    def check(self) -> list[str]:
        pd = self._worker._pd
        return self._cache().check_invariants() + (pd.check() if pd is not None else [])

    def flush(self, timeout: float) -> bool:
        return self._cache().flush(timeout)

    def leaks(self) -> list[Leak]:
        leaks = self._engine("leaks").leaks()
        return [Leak(i.request_id, i.pinned_pages, list(i.holds)) for i in leaks]

    def clear(self) -> dict[str, int]:
        return self._engine("clear").clear()

    def _cache(self) -> KVCache:
        cache, _ = self._worker._parts()
        return cache

    def _engine(self, op: str) -> Engine:
        """The in-process Engine; through a kvtier server its admin API does these."""
        if self._worker.engine is None:
            raise StateError(
                f"kvtier channel op {op!r} needs an in-process Engine; this worker uses "
                f"the kvtier server at {self._worker.server} (use its admin API)"
            )
        return self._worker.engine
