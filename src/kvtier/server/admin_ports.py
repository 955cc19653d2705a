"""Which port each model's admin API gets in a ``kvtier server``: one derived from the model's
fingerprint, so it is the same across server restarts (scrape targets and bookmarks keep
working), whatever order the models' first clients connect in.

::

    port = internal_api_server_port_start + int(fingerprint[:8], 16) % span
    span = min(MODEL_PORT_SPAN, 65536 - PORT_ATTEMPTS - internal_api_server_port_start)

The admin server tries that port and the next ``PORT_ATTEMPTS - 1`` when it is taken, so two
models whose fingerprints meet on one port both get one (the second then on the next free
port, logged as for any model). ``internal_api_server_port_start: 0`` keeps "any free
port" (not stable: the URL is logged and in ``client.stats()["server"]["admin_url"]``).
"""

from __future__ import annotations

from kvtier.admin.server import PORT_ATTEMPTS

MODEL_PORT_SPAN = 1000  # the ports a server's models spread over, above port_start


def model_admin_port(port_start: int, fingerprint: str) -> int:
    """The admin port of the model with ``fingerprint`` (hex) under ``port_start``; 0 stays
    0 (any free port)."""
    if port_start == 0:
        return 0
    span = max(1, min(MODEL_PORT_SPAN, 65536 - PORT_ATTEMPTS - port_start))
    return port_start + int(fingerprint[:8], 16) % span
