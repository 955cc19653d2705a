"""The PD transports, chosen by ``transfer_channel``: the factory that picks one.

Each transport imports only :mod:`kvtier.pd.channels.base`; this module imports them, lazily,
so ``nixl`` is loaded only where it is asked for.
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
