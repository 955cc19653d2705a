"""PD's hand-off on the scheduler side: what a request's ``kv_transfer_params`` say, what a
prefiller answers, and (xPyD) the decoder's pull before its lookup.

Through any standard proxy (vllm-router, vLLM's example proxies); the proxy copies the
prefiller's answer into the decode request, as it does for NixlConnector::

    proxy ──▶ prefiller  {"do_remote_decode": true, ...}      a PD sender names a transfer
    prefiller ──▶ proxy  {"do_remote_prefill": true, "do_remote_decode": false,
                          "kvtier_transfer_id": id,             request_finished's answer
                          "remote_host": h, "remote_port": p}   (xPyD: where to pull from;
                                                                 "kvtier_remote_ports": one
                                                                 per TP rank when several)
    proxy ──▶ decoder    the same object                       a decoder given remote_host
                                                               pulls first (its lookup waits:
                                                               vLLM asks again next step),
                                                               then finds the chunks

A prefiller that pushes to the one decoder its config names answers no address; a decoder
without one in the request finds what was pushed to it.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.errors import KVTierError
from kvtier.integrations.vllm.metadata import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, TRANSFER_ID
from kvtier.integrations.vllm.rpc import LookupClient, PullFrom
from kvtier.repeated_log import RepeatedLog
from kvtier.request_salt import RequestSalt

log = logging.getLogger(__name__)

MAX_TRANSFER_ID = 256  # characters; a prefiller names ids of at most 97
REMOTE_HOST = "remote_host"  # NixlConnector's names, which the proxies pass on as they are
REMOTE_PORT = "remote_port"
REMOTE_PORTS = "kvtier_remote_ports"  # one per TP rank, when the prefiller has several
PULL_TIMEOUT_S = 120.0  # a pull still running this long is given up (the decoder prefills)


@dataclass(frozen=True, slots=True)
class Source:
    """Where a decoder pulls a transfer from: the prefiller's PD address, per TP rank."""

    host: str
    ports: tuple[int, ...]

    def port(self, rank: int) -> int:
        return self.ports[rank] if rank < len(self.ports) else self.ports[0]


class Handoff:
    def __init__(
        self,
        clients: list[LookupClient],
        *,
        pd_sender: str | None,
        loads: bool,
        complaints: RepeatedLog,
        pull_timeout: float = PULL_TIMEOUT_S,
    ) -> None:
        """``pd_sender``: a prefiller's engine id (its transfer ids start with it), else None."""
        self.clients = clients
        self.pd_sender = pd_sender
        self.loads = loads
        self.pull_timeout = pull_timeout
        self._complaints = complaints
        self._address: dict[str, Any] | None = None  # a pulled-from prefiller's, asked once

    # -- a request's params ----------------------------------------------------------------
    def transfer(self, params: Any) -> tuple[str | None, Source | None]:
        """The transfer a request belongs to, and (a decoder, xPyD) where to pull it from. A
        prefiller names a new one when the proxy asks it to prefill for a remote decoder; a
        decoder takes the one the prefiller named (anything but a short string is none)."""
        if not isinstance(params, dict):
            return None, None
        if self.pd_sender is not None:
            wanted = params.get(DO_REMOTE_DECODE) is True
            # At most 64 + 1 + 32 characters, whatever the engine id: a decoder takes it.
            return (f"{self.pd_sender[:64]}-{uuid.uuid4().hex}" if wanted else None), None
        named = params.get(TRANSFER_ID)
        if not self.loads or named is None:
            return None, None
        if not isinstance(named, str) or not 0 < len(named) <= MAX_TRANSFER_ID:
            self._ignore(TRANSFER_ID, named, f"not a string of 1 to {MAX_TRANSFER_ID} characters")
            return None, None
        return named, self._source(params)

    def _source(self, params: dict[str, Any]) -> Source | None:
        host, port = params.get(REMOTE_HOST), params.get(REMOTE_PORT)
        if host is None and port is None:
            return None  # pushed to this decoder (or not at all): nothing to pull
        ports = params.get(REMOTE_PORTS, [port])
        if (
            not isinstance(host, str)
            or not 0 < len(host) <= 255
            or not isinstance(ports, list)
            or not ports
            or not all(isinstance(p, int) and 0 < p < 65536 for p in ports)
        ):
            self._ignore(REMOTE_HOST, (host, port, ports), "a host name and TCP port(s)")
            return None
        return Source(host, tuple(ports))

    def _ignore(self, key: str, value: object, valid: str) -> None:
        self._complaints.warning(
            ("handoff", key),
            "kvtier PD: ignoring kv_transfer_params %s=%.80r: %s; the decoder prefills this "
            "request itself",
            key,
            value,
            valid,
        )

    # -- the prefiller's answer ------------------------------------------------------------
    def answer(self, transfer_id: str) -> dict[str, Any]:
        """What the prefiller's response carries for the decode request."""
        return {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            TRANSFER_ID: transfer_id,
            **self._pulled_from(),
        }

    def _pulled_from(self) -> dict[str, Any]:
        """The workers' PD source addresses (empty when they push to one decoder)."""
        if self._address is not None:
            return self._address
        try:
            sources = [client.stats().get("pd_source") for client in self.clients]
        except KVTierError as exc:  # asked again with the next request
            self._complaints.warning(("address",), "kvtier PD: no worker address: %s", exc)
            return {}
        if not all(isinstance(s, dict) for s in sources):
            self._address = {}
            return self._address
        ports = [int(s["port"]) for s in sources if isinstance(s, dict)]
        first = sources[0]
        assert isinstance(first, dict)
        address: dict[str, Any] = {REMOTE_HOST: str(first["host"]), REMOTE_PORT: ports[0]}
        if len(ports) > 1:
            address[REMOTE_PORTS] = ports
        self._address = address
        return address

    # -- the decoder's pull ----------------------------------------------------------------
    def pulled(
        self,
        transfer_id: str,
        tokens: list[int],
        salt: RequestSalt | None,
        source: Source,
        since: float,
    ) -> bool:
        """Start (or poll) every worker's pull of ``transfer_id``; True once all have ended,
        failed, or run past ``pull_timeout`` since ``since`` (time.monotonic())."""
        done = True
        for rank, client in enumerate(self.clients):
            pull = PullFrom(transfer_id, tokens, salt, source.host, source.port(rank))
            try:
                done = client.pull(pull) and done
            except KVTierError as exc:  # the worker cannot pull: it finds nothing, prefills
                self._complaints.warning(
                    ("pull", client.path), "kvtier PD: pull of %s: %s", transfer_id, exc
                )
        if not done and time.monotonic() - since > self.pull_timeout:
            log.warning(
                "kvtier PD: pull of %s from %s still running after %gs: prefilling instead",
                transfer_id,
                source.host,
                self.pull_timeout,
            )
            return True
        return done
