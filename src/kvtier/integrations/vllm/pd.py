"""kv_producer / kv_consumer: kvtier's PD sender and receiver inside vLLM's worker.

The only module of the vLLM integration that imports kvtier's PD transport (``kvtier.pd``).

    prefiller (kv_producer, pd_role sender)          decoder (kv_consumer, pd_role receiver)
    WorkerSide.save ── PDSender.send(transfer id) ──▶ PDReceiver ──▶ the Engine's PD buffer
                                                      (reservation in the transfer id's lease)
    decoder lookup (vLLM request id) finds the chunks in the PD tier and pins them;
    request_finished ends both leases: the request's and the transfer's.

The transfer id is the same on both sides: ``kvtier pd-proxy`` puts it in each request's
``kv_transfer_params`` (``{"kvtier_transfer_id": ...}``), since vLLM's own request ids differ
between the two instances.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.engine import Engine
from kvtier.errors import KVTierError
from kvtier.keys import ChunkSpan
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.sender import PDSender, chunks_from_kv

log = logging.getLogger(__name__)


class PDEndpoint:
    """The worker's end of PD transfer: a receiver on a decoder, a sender on a prefiller."""

    def __init__(self, engine: Engine, tp_rank: int) -> None:
        cfg = engine.config
        self.receiver: PDReceiver | None = None
        self.sender: PDSender | None = None
        if cfg.enable_pd and cfg.pd_role == "receiver":
            self.receiver = PDReceiver.for_engine(engine).open()
        elif cfg.enable_pd and cfg.pd_role == "sender":
            # Connects on the first send: the decoder may start after the prefiller.
            self.sender = PDSender.from_config(
                cfg, engine.layout, engine.fingerprint.hex(), tp_rank=tp_rank
            )

    def send(self, transfer_id: str, spans: Sequence[ChunkSpan], kv: torch.Tensor) -> bool:
        """Send ``spans`` of ``kv`` (``[2, layers, >=end, hidden]``). False when it failed:
        the decoder then prefills those tokens itself."""
        if self.sender is None or not spans:
            return False
        try:
            self.sender.send(transfer_id, chunks_from_kv(spans, kv))
            return True
        except KVTierError as exc:
            log.warning("kvtier PD: sending %s failed, the decoder prefills: %s", transfer_id, exc)
            return False

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.sender is not None:
            self.sender.close()
