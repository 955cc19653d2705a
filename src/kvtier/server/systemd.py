"""systemd's readiness protocol (``Type=notify``), without a dependency.

When systemd starts a service with ``NOTIFY_SOCKET`` set, the service sends ``READY=1`` to
that datagram socket once it serves, and ``STOPPING=1`` when it begins to shut down; with
``Type=notify`` units that depend on the server start only when it really listens. Without
the variable (a terminal, a container, ``Type=simple``) nothing is sent.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to ``$NOTIFY_SOCKET``; False when there is none or
    it cannot be reached (logged: readiness is a courtesy, never a reason to fail)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), address)
        return True
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], exc)
        return False
