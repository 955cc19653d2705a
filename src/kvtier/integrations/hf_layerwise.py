"""Layer-wise loads for the transformers connector: each layer's cached KV reaches the model's
device just before that layer computes, and a layer's compute waits only for its own copy.

The hit first lands whole in host staging (``Engine.retrieve_into``; pinned on CUDA, so that
the per-layer copies are asynchronous DMA) and the request's pins go at once. The prefill's
forward then runs over a :class:`LayerwiseLoad`'s cache: transformers calls
``cache.update(keys, values, i)`` in every attention layer before that layer reads its KV, and
that call is the per-layer hook::

    begin        layer 0's copy staging -> device slot 0 is queued: one batch, one fence
    update(i)    layer i's fence is waited (on a host: a timed wait; on CUDA the compute
                 stream waits for it, the host never does), then layer i+1's copy is queued
                 into slot (i+1) % 2 and runs while layer i computes; transformers' own
                 update then reads slot i % 2 into the layer's storage (one concatenation)
    finish       after the forward: every layer was updated once, in order

                  layer:   0        1        2       ...
    copy stream   [c0]  [c1]     [c2]     [c3]
    compute           w0 [L0] w1 [L1] w2 [L2] ...     wi: layer i's own fence only

The cache's layers are views of their slot from the start, so transformers sees the cached
length (masks, positions) before any byte lands.

Failure: a copy that fails, or (on a host) has not landed ``late_after_s`` after its layer
asked for it, or a layer that is skipped, raises :class:`LayerLoadFailed` out of the forward:
the connector recomputes the whole prompt without the cache. Never a half-loaded KV. A copy
given up on may still land later into its slot: slots and staging are reused only after every
copy of the previous load landed (:meth:`LayerwiseLoads.begin` settles them first).

CUDA: the copies are made through the :class:`~kvtier.memory.device.CopyEngine` (kvtier's load
stream) with a stream of this module's own as the "caller", so that closing a batch orders
only that side stream after the copy; the compute stream waits for the side stream when its
layer asks. Before a slot is rewritten, the side stream waits for the compute stream, so the
copy into slot (i+1) % 2 starts after layer i-1 read it.

Memory: the device holds two slots of one layer each (``[planes, rows, hidden]``, rows the
hit rounded up to whole chunks): 2/L of the hit's KV, counted in
:attr:`LayerwiseLoads.scratch_bytes`. Host staging holds the whole hit. Where the model's
memory is the host's (a CPU model and its copy engine), there are no slots: each layer reads
the staging itself and every fence has landed.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import torch

from kvtier.errors import KVTierError
from kvtier.integrations.hf_kv import layer_kv
from kvtier.layout import KVLayout
from kvtier.memory.device import LANDED, CopyEngine, Direction, Landed

log = logging.getLogger(__name__)

SLOTS = 2  # layer i+1 copies while layer i computes


class LayerLoadFailed(KVTierError):
    """A layer's copy failed or came late: the prefill recomputes the whole prompt."""


class LayerwiseLoads:
    """One connector's layer-wise loads: its host staging and device slots, reused from one
    prefill to the next. Used by one thread (the connector's)."""

    def __init__(
        self,
        layout: KVLayout,
        device: torch.device,
        copies: CopyEngine,
        *,
        chunk_size: int,
        latent_split_at: int = 0,
        late_after_s: float = 30.0,
    ) -> None:
        self.layout = layout
        self.device = device
        self.copies = copies
        self.chunk_size = chunk_size
        self.latent_split_at = latent_split_at
        self.late_after_s = late_after_s
        self._cuda = device.type == "cuda"
        # Copies that may land after they return need device slots; where the model's memory
        # is the host's, each layer reads the staging itself.
        self.via_slots = copies.on_device(torch.empty(0, dtype=layout.dtype, device=device))
        self._staging: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []
        # CUDA: the stream that "calls" the copies (see the module docstring).
        self.side_stream: Any = None
        if self._cuda:
            self.side_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.unsettled: list[Landed] = []  # every fence of the last load
        self.loads = 0  # prefills whose every layer loaded
        self.failures = 0  # prefills whose layer-wise load failed (recomputed)

    @property
    def scratch_bytes(self) -> int:
        """Device memory held for loads (the two slots)."""
        return sum(s.numel() * s.element_size() for s in self._slots)

    def staging_for(self, tokens: int) -> torch.Tensor:
        """A host ``[planes, L, >=tokens, hidden]`` buffer for a hit (pinned on CUDA), free to
        write: every copy that read it before has landed."""
        self._settle()
        if self._staging is None or self._staging.shape[2] < tokens:
            capacity = -(-tokens // self.chunk_size) * self.chunk_size
            self._staging = torch.empty(
                self.layout.kv_shape(capacity), dtype=self.layout.dtype, pin_memory=self._cuda
            )
        return self._staging

    def begin(self, staging: torch.Tensor, tokens: int) -> Any:
        """A transformers cache holding ``staging``'s first ``tokens`` tokens, loaded layer by
        layer as the forward asks for them (layer 0's copy is queued now)."""
        self._settle()
        if self.via_slots:
            self._slots_for(tokens)
        load = LayerwiseLoad(self, staging, tokens)
        load.queue(0)
        return _cache_class()(load)

    def slot(self, layer: int) -> torch.Tensor:
        """The device slot that layer ``layer``'s copy lands in."""
        return self._slots[layer % SLOTS]

    def _slots_for(self, tokens: int) -> None:
        if self._slots and int(self._slots[0].shape[1]) >= tokens:
            return
        planes, _, _, hidden = self.layout.kv_shape(0)
        capacity = -(-tokens // self.chunk_size) * self.chunk_size  # whole chunks, then kept
        self._slots = [
            torch.empty((planes, capacity, hidden), dtype=self.layout.dtype, device=self.device)
            for _ in range(SLOTS)
        ]

    def _settle(self) -> None:
        """Wait for every copy of the last load (given up on, or still reading the staging)."""
        unsettled, self.unsettled = self.unsettled, []
        for landed in unsettled:
            landed.wait()


class LayerwiseLoad:
    """One prefill's layer-wise load (see the module docstring)."""

    def __init__(self, owner: LayerwiseLoads, staging: torch.Tensor, tokens: int) -> None:
        self._owner = owner
        self._staging = staging
        self.tokens = tokens
        self.num_layers = owner.layout.num_layers
        self._fences: dict[int, Landed | BaseException] = {}
        self.waited = 0  # layers whose KV is in place, in order

    @property
    def done(self) -> bool:
        return self.waited == self.num_layers

    def source(self, i: int) -> torch.Tensor:
        """Where layer ``i``'s KV is read from: its slot, or the staging itself."""
        if self._owner.via_slots:
            return self._owner.slot(i)
        return self._staging[:, i]

    def queue(self, i: int) -> None:
        """Queue layer ``i``'s copy staging -> its slot (one batch per layer, one fence)."""
        owner = self._owner
        if not owner.via_slots:
            self._fences[i] = LANDED
            return
        slot, n = owner.slot(i), self.tokens
        try:
            if owner.side_stream is not None:
                # The slot's last reader (layer i-2's update) ran on the compute stream.
                owner.side_stream.wait_stream(torch.cuda.current_stream(owner.device))
                with torch.cuda.stream(owner.side_stream):
                    landed = self._copy(slot, n, i)
            else:
                landed = self._copy(slot, n, i)
        except (KVTierError, RuntimeError) as exc:  # RuntimeError: a device copy's own
            self._fences[i] = exc
            return
        self._fences[i] = landed
        owner.unsettled.append(landed)

    def _copy(self, slot: torch.Tensor, n: int, i: int) -> Landed:
        batch = self._owner.copies.begin(slot, Direction.LOAD)
        for plane in range(slot.shape[0]):  # contiguous per plane: one DMA each
            batch.copy(slot[plane, :n], self._staging[plane, i, :n])
        return batch.close()

    def arrive(self, i: int) -> None:
        """Layer ``i`` is about to read its KV: it is in place when this returns (on CUDA: the
        compute stream is ordered after its copy), and layer ``i+1``'s copy is on its way."""
        if i != self.waited:  # a layer never asked for: its KV was never waited for
            self._fail(f"layer {i} asked before layer {self.waited}")
        fence = self._fences.pop(i, None)
        if fence is None or isinstance(fence, BaseException):
            self._fail(f"layer {i}'s copy failed: {fence}")
        elif self._owner.side_stream is not None:
            torch.cuda.current_stream(self._owner.device).wait_stream(self._owner.side_stream)
        elif not _landed_within(fence, self._owner.late_after_s):
            self._fail(f"layer {i}'s copy has not landed after {self._owner.late_after_s} s")
        self.waited = i + 1
        if self.waited < self.num_layers:
            self.queue(self.waited)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self._owner
        return layer_kv(
            self.source(i), owner.layout, self.tokens, latent_split_at=owner.latent_split_at
        )

    def finish(self) -> None:
        """The forward is over: a load not waited for in every layer is a failure."""
        if not self.done:
            self._fail(f"the forward asked for {self.waited} of {self.num_layers} layers")
        self._owner.loads += 1

    def _fail(self, why: str) -> None:
        self._owner.failures += 1
        log.warning("kvtier: layer-wise load failed, the prompt is recomputed: %s", why)
        raise LayerLoadFailed(why)


def _landed_within(landed: Landed, seconds: float) -> bool:
    """Whether ``landed`` lands within ``seconds``. A fence's own wait has no timeout, so it
    runs on a helper thread (only engines whose copies land late on a host get here: a test's,
    or one whose device memory is not CUDA)."""
    if landed.done():
        return True
    arrived = threading.Event()

    def wait() -> None:
        try:
            landed.wait()
        except BaseException:  # a copy that fails never lands: late
            return
        arrived.set()

    threading.Thread(target=wait, name="kvtier-layer-fence", daemon=True).start()
    return arrived.wait(seconds)


@functools.cache
def _cache_class() -> type:
    """The cache class, made on first use: transformers is imported lazily."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class LayerwiseCache(DynamicCache):
        """A ``DynamicCache`` whose first update of each layer waits for that layer's load."""

        def __init__(self, load: LayerwiseLoad) -> None:
            super().__init__()
            self.kvtier_load: LayerwiseLoad | None = load
            for i in range(load.num_layers):
                layer = DynamicLayer()  # type: ignore[no-untyped-call]
                keys, values = load.layer(i)
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
                self.layers.append(layer)

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            load = self.kvtier_load
            if load is not None and not load.done:
                load.arrive(layer_idx)
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            return keys, values

    return LayerwiseCache
