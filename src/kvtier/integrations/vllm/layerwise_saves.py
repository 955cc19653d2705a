"""Layer-wise saves (``use_layerwise: true``): each attention layer's part of the step's saves
leaves vLLM's blocks right after that layer computed, and the stores start once every layer's
copy landed, behind the step.

vLLM calls ``save_kv_layer(name)`` after every attention layer and ``wait_for_save`` after the
forward (:mod:`.layerwise` draws the loads' side of the same hooks). For the step's saves::

    save_kv_layer(0)   the step's plan: the saves wait_for_save would store whole-chunk (the
                       skip rules of :mod:`.worker_saves` applied), less a PD prefiller's
                       (stored and sent inline, as ever); their rows packed in one buffer
    save_kv_layer(i)   layer i's rows gathered out of its blocks (the model's stream, after
                       layer i's compute) into the buffer; KV on a device: the buffer's layer
                       i queued to its host staging on kvtier's store stream, one batch and
                       one fence per layer, and the call returns
    wait_for_save      every layer copied: the stores go to the drain (:mod:`.save_drain`),
                       whose thread waits for every layer's fence, then stores the staging
                       (KV in host memory: gathered into the staging itself, stored now).
                       A layer not copied: every save of the plan is skipped, never half-
                       stored; a request whose load failed meanwhile is skipped as ever

                  layer:   0          1          2
    model stream       [L0] g0    [L1] g1    [L2] g2  (wait_for_save returns)
    store stream               c0         c1         c2 -> drain thread: wait c0..c2, store

The bytes stored are the whole-chunk save's: the same gather, one layer at a time, into the
same chunk layout (the staging), stored by the same ``store`` call from it.

Memory: the device buffer is one of the drain's (``IN_FLIGHT`` at most, as whole-chunk saves
take), with a host twin of the same rows (pinned on CUDA, so the per-layer copies are true
asynchronous DMA); both go back once the drain stored them. A host KV needs no device buffer
and no copy: the gather writes the staging.

Not layer-wise (whole chunks in ``wait_for_save``, as with the mode off): models with several
KV-cache groups or with state layers (:meth:`LayerLoads.serves`), a PD prefiller's saves, and
a step whose hooks never came (a step with no forward). The hooks of one step all carry the
same metadata object: a new one starts a new plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from kvtier.errors import StateError
from kvtier.integrations.vllm.copy_buffer import CopyBuffer
from kvtier.integrations.vllm.layerwise import layer_views
from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.integrations.vllm.save_drain import SaveDrain
from kvtier.layout import KVLayout
from kvtier.memory.device import CopyEngine, Direction, Landed

log = logging.getLogger(__name__)
_HOST = torch.device("cpu")


class SavePath(Protocol):
    """What the worker's save path (:class:`~.worker_saves.WorkerSaves`) lends a layer-wise
    save: its skip rules and its store."""

    def wanted(self, spec: SaveSpec) -> bool:
        """Whether ``spec`` can be saved whole now (the skip rules)."""
        ...

    def job(self, spec: SaveSpec, out: torch.Tensor, base: int) -> Callable[[], None]:
        """The store of ``spec`` from ``out`` (row 0: token ``base``), to run once ``out``
        holds every layer."""
        ...


@dataclass
class _Piece:
    """One save of the step's plan."""

    spec: SaveSpec
    offset: int  # its first row in the step's buffer
    base: int  # the token of its row 0 (its first chunk's start)

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.spec.end - self.base)


class LayerSaves:
    """See the module docstring. Used by vLLM's model thread only."""

    def __init__(
        self,
        path: SavePath,
        paged: PagedKV,
        layout: KVLayout,
        chunk_size: int,
        drain: SaveDrain,
        copies: CopyEngine,
    ) -> None:
        self._path = path
        self._layout = layout
        self._chunk_size = chunk_size
        self._drain = drain
        self._copies = copies
        self._views = layer_views(paged)
        self._index = {name: i for i, name in enumerate(paged.layer_names)}
        # KV whose copies to host memory may land late: gathered on the device, then copied.
        self._late = copies.on_device(paged.layers[0])
        self._staging = CopyBuffer(layout, chunk_size, _HOST)  # a host KV's (late: twins)
        self._meta: KVTierMetadata | None = None  # the step being saved
        self._pieces: list[_Piece] = []
        self._rows = 0
        self._buffer: CopyBuffer | None = None  # the drain's, while a late plan holds it
        self._device: torch.Tensor | None = None  # its rows: the gathers' target
        self._host: torch.Tensor | None = None  # the staging the stores read
        self._landed: list[Landed] = []  # one fence per layer copied
        self._next = 0  # the layer whose hook comes next
        self._broken: str | None = None  # why the plan cannot be whole
        self.saves = 0  # saves stored layer by layer
        self.skips = 0  # saves skipped: a layer was never copied

    # -- vLLM's hooks ----------------------------------------------------------------------
    def layer(self, layer_name: str, meta: KVTierMetadata) -> None:
        """After ``layer_name`` computed (``save_kv_layer``): its part of every save of the
        plan is gathered, and on a device queued to host memory; returns without waiting."""
        i = self._index.get(layer_name)
        if i is None:
            return  # not a layer whose KV kvtier keeps
        if meta is not self._meta:
            self._abandon("a new step began before wait_for_save")
            self._begin(meta)
        if not self._pieces or self._broken is not None:
            return
        if i != self._next:
            self._broken = f"layer {i}'s hook came when layer {self._next}'s was due"
            return
        self._copy(i)
        self._next = i + 1

    def close(self, meta: KVTierMetadata) -> list[SaveSpec]:
        """``wait_for_save``: hand the plan's stores to the drain (or store them, a host KV)
        if every layer was copied, else skip them all. Returns the saves of ``meta`` the plan
        took (stored or skipped): the rest are saved whole-chunk."""
        if meta is not self._meta:
            self._abandon("its step ended without wait_for_save")
            return []
        pieces, host = self._pieces, self._host
        broken = self._broken
        if broken is None and pieces and self._next < len(self._views):
            broken = f"the forward saved {self._next} of {len(self._views)} layers"
        if broken is not None:
            log.warning("kvtier: layer-wise saves of %d request(s) skipped: %s", len(pieces),
                        broken)  # fmt: skip
            self.skips += len(pieces)
            keep: list[_Piece] = []
        else:
            # A layer-wise load that failed during the forward made its request short.
            keep = [p for p in pieces if self._path.wanted(p.spec)]
        jobs: dict[int, Callable[[], None]] = {}
        for piece in keep:
            assert host is not None
            jobs[id(piece)] = self._path.job(piece.spec, host[:, :, piece.rows], piece.base)
        self.saves += len(jobs)
        late = self._late and self._buffer is not None
        if late:
            self._submit(pieces, jobs)
        self._reset(None)  # before a store runs here: one that raises leaves no plan behind
        if not late:
            for job in jobs.values():
                job()
        return [p.spec for p in pieces]

    # -- helpers ---------------------------------------------------------------------------
    def _begin(self, meta: KVTierMetadata) -> None:
        """The step's plan: its saves that can go layer by layer, packed in one buffer."""
        self._reset(meta)
        rows = 0
        for spec in meta.saves:
            if spec.from_cache or spec.transfer_id is not None or not self._path.wanted(spec):
                continue  # a PD prefiller's (inline), or one the skip rules drop anyway
            base = spec.start // self._chunk_size * self._chunk_size
            self._pieces.append(_Piece(spec, rows, base))
            rows += spec.end - base
        if not self._pieces:
            return
        self._rows = rows
        if self._late:
            self._buffer = self._drain.take()  # waits while IN_FLIGHT saves still copy
            self._device = self._buffer.rows(rows)
            self._host = self._drain.host_twin(self._buffer).rows(rows)
        else:
            self._host = self._staging.rows(rows)

    def _copy(self, i: int) -> None:
        """Layer ``i`` of every piece: gathered, and on a device queued to host memory."""
        target = self._device if self._late else self._host
        assert target is not None
        view = self._views[i]
        for piece in self._pieces:
            spec = piece.spec
            view.gather(spec.tables, spec.start, spec.end, target[:, i : i + 1, piece.rows],
                        piece.base)  # fmt: skip
        if not self._late:
            return
        assert self._host is not None and self._device is not None
        # One batch, one fence per layer; the batch waits for the model's stream first (the
        # gather above, after layer i's compute), and the model's stream never waits for it.
        batch = self._copies.begin(self._device, Direction.STORE)
        batch.copy(self._host[:, i, : self._rows], self._device[:, i, : self._rows])
        self._landed.append(batch.close())

    def _abandon(self, why: str) -> None:
        if self._pieces:
            log.warning("kvtier: layer-wise saves of %d request(s) skipped: %s",
                        len(self._pieces), why)  # fmt: skip
            self.skips += len(self._pieces)
        if self._buffer is not None:
            self._submit(self._pieces, {})  # its copies may still run: nothing is stored
        self._reset(None)

    def _submit(self, pieces: Sequence[_Piece], jobs: dict[int, Callable[[], None]]) -> None:
        """One drain job per piece, in order (each request counts as saving until its own is
        done): the first waits for every layer's fence, each stores its piece if it has a
        job, and the last gives the buffer back, after every copy out of it landed."""
        assert self._buffer is not None
        fences = _Fences(self._landed)
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            store = partial(_store_after, fences, jobs.get(id(piece)))
            self._drain.submit(piece.spec.request_id, store, self._buffer if last else None)

    def _reset(self, meta: KVTierMetadata | None) -> None:
        self._meta = meta
        self._pieces, self._rows, self._landed = [], 0, []
        self._buffer = self._device = self._host = None
        self._next, self._broken = 0, None


class _Fences:
    """A plan's per-layer fences, waited for once on the drain thread; a copy that failed
    fails every store of the plan (never half-stored)."""

    def __init__(self, landed: Sequence[Landed]) -> None:
        self._landed = list(landed)
        self._error: Exception | None = None

    def wait(self) -> None:
        if self._error is not None:
            raise StateError("a layer's copy of this step's saves failed") from self._error
        try:
            for fence in self._landed:
                fence.wait()
        except Exception as exc:
            self._error = exc
            raise
        self._landed = []


def _store_after(fences: _Fences, job: Callable[[], None] | None) -> None:
    fences.wait()
    if job is not None:
        job()
