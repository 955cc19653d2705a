"""Each model's admin port in a kvtier server comes from its fingerprint: the same after a
server restart, whatever order the models' clients come in (issue 50, item 7: it was given
in connection order, 7200 one day and 7199 the next)."""

from __future__ import annotations

import random
from urllib.parse import urlsplit

from kvtier.server.admin_ports import MODEL_PORT_SPAN, model_admin_port
from tests.server.server_helpers import InProcess, open_client, remove_tempdir, short_tempdir

MODELS = ("model-a", "model-b")


def _admin_ports(directory: str, base: int, order: tuple[str, ...]) -> dict[str, int]:
    server = InProcess(
        directory, internal_api_server_enabled="true", internal_api_server_port_start=base
    )
    try:
        ports: dict[str, int] = {}
        for model in order:
            with open_client(server.url, model_name=model) as client:
                url = client.stats()["server"]["admin_url"]
                port = urlsplit(url).port
                assert port is not None
                assert port == model_admin_port(base, client.fingerprint.hex())
                ports[model] = port
        return ports
    finally:
        server.close()


def test_each_models_admin_port_survives_a_restart_in_any_order() -> None:
    base = random.randrange(20000, 40000)
    directory = short_tempdir()
    try:
        first = _admin_ports(directory, base, MODELS)
        again = _admin_ports(directory, base, tuple(reversed(MODELS)))
    finally:
        remove_tempdir(directory)
    assert first == again
    assert all(base <= port < base + MODEL_PORT_SPAN for port in first.values())


def test_the_port_is_spread_over_the_span_and_zero_stays_any() -> None:
    assert model_admin_port(0, "ab" * 16) == 0
    ports = {model_admin_port(7000, f"{n:08x}" + "0" * 24) for n in range(0, 1 << 20, 997)}
    assert min(ports) >= 7000 and max(ports) < 7000 + MODEL_PORT_SPAN and len(ports) > 500
    assert model_admin_port(65000, "ffffffff" + "0" * 24) <= 65535 - 15  # room to probe
