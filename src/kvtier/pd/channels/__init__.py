"""The PD transports, chosen by ``transfer_channel``: the factory that picks one.

Each transport imports only :mod:`kvtier.pd.channels.base`; this module imports them, lazily,
so ``nixl`` is loaded only where it is asked for.

Words: in kvtier a *channel* is a PD transport (``tcp``, ``shm``, ``nixl``: how chunk bytes
go from a prefiller to a decoder), and nothing else; a *link* is a client's self-healing
connection to one server (:class:`~kvtier.storage.redis.link.RedisLink`,
:class:`~kvtier.server.link.ServerLink`); the vLLM worker's PD sender/receiver pair is its
*endpoint* (``integrations/vllm/pd.py``).
"""

from __future__ import annotations

from kvtier.config.channels import check_channel
from kvtier.pd.channels.base import ReceiverChannel, SenderChannel


def receiver_channel(name: str | None) -> ReceiverChannel:
    chosen = check_channel(name)
    if chosen == "nixl":
        from kvtier.pd.channels.nixl import NixlReceiver

        return NixlReceiver()
    if chosen == "shm":
        from kvtier.pd.channels.shm import ShmReceiver

        return ShmReceiver()
    from kvtier.pd.channels.tcp import TcpReceiver

    return TcpReceiver()


def sender_channel(name: str | None) -> SenderChannel:
    chosen = check_channel(name)
    if chosen == "nixl":
        from kvtier.pd.channels.nixl import NixlSender

        return NixlSender()
    if chosen == "shm":
        from kvtier.pd.channels.shm import ShmSender

        return ShmSender()
    from kvtier.pd.channels.tcp import TcpSender

    return TcpSender()
