"""kv_producer / kv_consumer: kvtier's PD transfer inside vLLM's worker.

The only module of the vLLM integration that imports kvtier's PD transport (``kvtier.pd``): the
sender. A decoder's receiver is opened (and closed) by the worker's cache, a
:class:`~kvtier.service.Service`, with the engine it writes into.

    prefiller (kv_producer, pd_role sender)          decoder (kv_consumer, pd_role receiver)
    WorkerSide.save ── PDSender.send(transfer id) ──▶ PDReceiver ──▶ the Engine's PD buffer
      (PDEndpoint, this module)                       (opened by the worker's Service)
                                                      (reservation in the transfer id's lease)
    decoder lookup (vLLM request id) finds the chunks in the PD tier and pins them;
    request_finished ends both leases: the request's and the transfer's.

The transfer id is the same on both sides, since vLLM's own request ids differ between the two
instances: the prefiller names it when a proxy's prefill request carries ``kv_transfer_params``
``{"do_remote_decode": true}`` and answers it in its response's ``kv_transfer_params``
(``{"do_remote_prefill": true, "kvtier_transfer_id": ...}``); the proxy (vllm-router, vLLM's
example proxies) puts that answer in the decode request, as it does for NixlConnector. The
scheduler side (:mod:`.scheduler`) draws the exchange.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.engine import Engine
from kvtier.errors import KVTierError
from kvtier.keys import ChunkSpan
from kvtier.pd.sender import PDSender, chunks_from_kv

log = logging.getLogger(__name__)


class PDEndpoint:
    """The prefiller worker's end of PD transfer: a sender (``pd_role: sender``). The decoder's
    receiver is its :class:`~kvtier.service.Service`'s, opened with the cache."""

    def __init__(self, engine: Engine, tp_rank: int) -> None:
        cfg = engine.config
        # Connects on the first send: the decoder may start after the prefiller.
        self.sender = PDSender.from_config(
            cfg, engine.layout, engine.fingerprint.hex(), tp_rank=tp_rank
        )

    def send(self, transfer_id: str, spans: Sequence[ChunkSpan], kv: torch.Tensor) -> bool:
        """Send ``spans`` of ``kv`` (``[2, layers, >=end, hidden]``). False when it failed:
        the decoder then prefills those tokens itself."""
        if not spans:
            return False
        try:
            self.sender.send(transfer_id, chunks_from_kv(spans, kv))
            return True
        except KVTierError as exc:
            log.warning("kvtier PD: sending %s failed, the decoder prefills: %s", transfer_id, exc)
            return False

    def close(self) -> None:
        self.sender.close()
