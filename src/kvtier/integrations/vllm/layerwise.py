"""Layer-wise loads (``use_layerwise: true``): each attention layer's KV reaches vLLM's blocks
just before that layer computes, and a layer's compute waits only for its own copy.

vLLM calls ``start_load_kv`` before the forward, then ``wait_for_layer_load(name)`` before and
``save_kv_layer`` after every attention layer (``maybe_transfer_kv_layer``; its CPU build
too). For the step's CPU-tier loads::

    start_load_kv     every load's chunks -> host staging (all layers: kvtier pages are whole
                      chunks; a disk/Redis hit would land there the same way), then layer 0's
                      copy staging -> device slot 0 is queued: one batch, one fence
    wait(layer i)     layer i+1's copy is queued (slot (i+1) % 2) while layer i computes;
                      layer i's fence is waited (on a host) or ordered before the model's
                      stream (on CUDA: ``order_current_stream``, layer i's event only),
                      and slot i % 2 is scattered into layer i's blocks
    last layer /      anything not scattered by then fails its request (see below)
    wait_for_save

                  layer:   0        1        2       ...
    copy stream   [c0][c1]     [c2]     [c3]
    compute            w0 [L0] w1 [L1] w2 [L2] ...     wi: layer i's own fence only

Each copy is closed without ordering the model's stream (``close(order_caller=False)``,
:mod:`kvtier.memory.device`): closing layer i+1's batch before layer i computes would
otherwise make layer i wait for layer i+1's copy too. Layer i's fence orders the stream in
its own wait, just before its scatter and its compute are queued.

Failure: a copy that fails, or has not landed ``late_after_s`` after its layer asked for it,
turns every request of the step's layer-wise load into a miss from its first loaded token
(:meth:`Loads.record_short` with nothing delivered): vLLM discards the step's output for it
and recomputes, overwriting whatever layers were scattered. Never a half-loaded KV. A late
copy that was given up on still lands into its slot later: slots are reused only after it.

Memory: the device holds two slots of one layer each (``[planes, rows, hidden]``, rows the
step's load tokens): 2/L of the load's KV, counted in :attr:`LayerLoads.scratch_tokens` as
whole-chunk-equivalent rows. Host staging holds the whole load (pinned on CUDA).

Not layer-wise (whole chunks, as with the mode off): async loads (disk/Redis hits that load
while the request waits, before any forward reads them), models with several KV-cache
groups or with state layers, and a worker whose KV is host memory needs no slots at all
(the scatter reads the staging).

Saves go layer by layer in the same mode: :mod:`.layerwise_saves`.

Test hook: ``KVTIER_FAULT_LOAD_LAYER=k`` fails every layer-wise load at layer ``k`` (the
vLLM tests' way to inject a failure into a spawned worker).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from kvtier.errors import KVTierError
from kvtier.integrations.vllm.loads import Loads, scratch_tokens
from kvtier.integrations.vllm.metadata import LoadSpec
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.memory.device import LANDED, CopyEngine, Direction, Fence, Landed

log = logging.getLogger(__name__)

FAULT_ENV = "KVTIER_FAULT_LOAD_LAYER"
SLOTS = 2  # layer i+1 copies while layer i is scattered and computes
DeviceMemory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class _Piece:
    """One request's part of the step's layer-wise load."""

    spec: LoadSpec
    host: torch.Tensor  # [planes, layers, rows, hidden]; row 0 is token ``base``
    offset: int  # its first row in a device slot
    base: int
    loaded: int  # tokens [spec.start, loaded) go to vLLM's blocks


def layer_views(paged: PagedKV) -> list[PagedKV]:
    """One single-layer view per layer: its scatter or gather touches that layer only (on
    CUDA through a kernel of its own one layer: the model's kernel moves every layer)."""
    views = [
        replace(paged, layers=(t,), layer_names=(n,), layer_groups=(), kernel=None)
        for t, n in zip(paged.layers, paged.layer_names, strict=True)
    ]
    return views if paged.kernel is None else [view.with_kernel() for view in views]


class LayerLoads:
    """See the module docstring. Used by vLLM's model thread only."""

    def __init__(
        self,
        loads: Loads,
        paged: PagedKV,
        copies: CopyEngine,
        *,
        late_after_s: float = 30.0,
        device_memory: DeviceMemory = _empty,
    ) -> None:
        self._loads = loads
        self._paged = paged
        self._copies = copies
        self.late_after_s = late_after_s
        self._device_memory = device_memory
        self._index = {name: i for i, name in enumerate(paged.layer_names)}
        self._views = layer_views(paged)
        self._device = paged.layers[0].device
        # Copies that may land after they return need slots of device memory; on a host the
        # scatter reads the staging itself.
        self._via_slots = copies.on_device(paged.layers[0])
        # On CUDA a layer's fence orders the model's stream (order_current_stream): the
        # host never waits (and cannot see "late").
        self._stream_ordered = self._device.type == "cuda"
        self._slots: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None  # flat host bytes, grown and kept
        self._pieces: list[_Piece] = []
        self._landed: dict[int, Fence] = {}
        self._unsettled: list[Landed] = []
        self._next = 0  # the next layer whose copy to queue
        self._waited = 0  # layers waited for, in order
        self._fault_layer: int | None = None  # read each step: a test sets it after opening
        self.loads = 0  # requests loaded layer by layer, whole
        self.failures = 0  # requests whose layer-wise load failed

    @staticmethod
    def serves(paged: PagedKV, loads: Loads) -> bool:
        """Whether this model's loads can go layer by layer (one KV-cache group, no
        states): otherwise they stay whole-chunk."""
        return paged.num_groups == 1 and loads.states is None

    @property
    def scratch_tokens(self) -> int:
        """Device memory held for loads, in token rows of whole chunks (all layers)."""
        if not self._slots:
            return 0
        rows = sum(int(s.shape[1]) for s in self._slots)
        return -(-rows // len(self._paged.layers))

    # -- the step --------------------------------------------------------------------------
    def begin(self, specs: Sequence[LoadSpec]) -> None:
        """Land the step's sync loads in host staging and queue layer 0's copy."""
        self.finish()
        self._settle()
        if not specs:
            return
        chunk = self._loads.cache.config.chunk_size
        layout = self._loads.cache.layout
        sizes = [scratch_tokens(spec, chunk) for spec in specs]
        staging = self._staging_for(sum(math.prod(layout.kv_shape(n)) for n in sizes))
        flat, rows = 0, 0
        for spec, n in zip(specs, sizes, strict=True):
            shape = layout.kv_shape(n)
            host = staging[flat : flat + math.prod(shape)].view(shape)
            flat += math.prod(shape)
            loaded = self._loads.fetch(spec, host)
            self._loads.record_short(spec, loaded)  # a short hit: as a whole-chunk load
            if loaded > spec.start:
                base = spec.start // chunk * chunk
                self._pieces.append(_Piece(spec, host, rows, base, loaded))
                rows += loaded - base
        if not self._pieces:
            return
        fault = os.environ.get(FAULT_ENV)
        self._fault_layer = int(fault) if fault else None
        if self._via_slots:
            self._slots_for(rows)
        self._next, self._waited = 0, 0
        self._queue(0)
        self._next = 1

    def wait(self, layer_name: str) -> None:
        """Before layer ``layer_name`` computes: its KV is in vLLM's blocks (or its
        requests are misses); the next layer's copy is on its way."""
        i = self._index.get(layer_name)
        if i is None or not self._pieces:
            return
        if i != self._waited:  # a layer whose wait never came: its KV may be garbage
            self._fail(f"layer {self._waited} was not waited for before layer {i}")
            return
        if self._next < len(self._views):
            self._queue(self._next)
            self._next += 1
        landed = self._landed.pop(i)
        try:
            on_time = self._land(landed)
        except (KVTierError, RuntimeError) as exc:  # RuntimeError: a device copy's own
            on_time, landed = False, LANDED
            log.warning("kvtier: layer %d copy failed: %s", i, exc)
        if self._stream_ordered:
            self._unsettled.append(landed)  # staging is rewritten only once it landed
        if not on_time:
            self._unsettled.append(landed)
            self._fail(f"layer {i}'s copy has not landed after {self.late_after_s} s")
            return
        if i == self._fault_layer:
            self._fail(f"layer {i}: fault injected ({FAULT_ENV})")
            return
        # The scatter and layer i's compute, queued next, wait for layer i's copy only.
        landed.order_current_stream()
        self._scatter(i)
        self._waited = i + 1
        if self._waited == len(self._views):
            self.finish()

    def finish(self) -> None:
        """The forward is over: a load not scattered into every layer is a miss."""
        if self._pieces and self._waited < len(self._views):
            self._fail(f"the forward waited for {self._waited} of {len(self._views)} layers")
        self.loads += len(self._pieces)
        self._pieces = []
        self._unsettled.extend(self._landed.values())
        self._landed = {}

    def close(self) -> None:
        self.finish()
        self._settle()

    # -- helpers ---------------------------------------------------------------------------
    def _queue(self, i: int) -> None:
        """Queue layer ``i``'s copy from host staging into its slot (one batch, one fence)."""
        if not self._via_slots:
            self._landed[i] = LANDED
            return
        slot = self._slots[i % SLOTS]
        batch = self._copies.begin(slot, Direction.LOAD)
        for piece in self._pieces:
            first, n = piece.spec.start - piece.base, piece.loaded - piece.base
            rows = slice(piece.offset + first, piece.offset + n)
            batch.copy(slot[:, rows], piece.host[:, i, first:n])
        # Not ordered now: the model's stream waits for it in layer i's own wait.
        self._landed[i] = batch.close(order_caller=False)

    def _land(self, landed: Landed) -> bool:
        """Whether ``landed`` landed within ``late_after_s`` (polled: a host copy's fence
        has no timed wait)."""
        if self._stream_ordered or landed.done():
            return True
        deadline = time.monotonic() + self.late_after_s
        while not landed.done():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def _scatter(self, i: int) -> None:
        view = self._views[i]
        for piece in self._pieces:
            spec = piece.spec
            if self._via_slots:
                n = piece.loaded - piece.base
                src = self._slots[i % SLOTS][:, piece.offset : piece.offset + n].unsqueeze(1)
            else:
                src = piece.host[:, i : i + 1]
            view.scatter(spec.tables, spec.start, piece.loaded, src, piece.base)

    def _fail(self, why: str) -> None:
        log.warning("kvtier: layer-wise load of %d request(s) failed: %s", len(self._pieces), why)
        for piece in self._pieces:
            self._loads.record_short(piece.spec, piece.spec.start)
        self.failures += len(self._pieces)
        self._pieces = []
        self._unsettled.extend(self._landed.values())
        self._landed = {}

    def _settle(self) -> None:
        """Wait for copies given up on (they still write into the slots) and, on CUDA, the
        last step's copies (they still read the staging)."""
        unsettled, self._unsettled = self._unsettled, []
        for landed in unsettled:
            landed.wait()

    def _staging_for(self, numel: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < numel:
            dtype = self._loads.cache.layout.dtype
            # Pinned on CUDA: the per-layer copies are then true asynchronous DMA.
            pin = self._device.type == "cuda"
            self._staging = torch.empty(numel, dtype=dtype, pin_memory=pin)
        return self._staging

    def _slots_for(self, rows: int) -> None:
        if self._slots and int(self._slots[0].shape[1]) >= rows:
            return
        chunk = self._loads.cache.config.chunk_size
        planes, _, _, hidden = self._loads.cache.layout.kv_shape(0)
        capacity = -(-rows // chunk) * chunk  # grown in whole chunks, then kept
        dtype = self._paged.layers[0].dtype
        self._slots = [
            self._device_memory((planes, capacity, hidden), dtype, self._device)
            for _ in range(SLOTS)
        ]
