"""The Redis servers the Redis tier's tests run against: one ``redis-server`` and one
3-master cluster per test module (a module that needs a server of its own per test, as the
fault tests do, defines ``server`` itself)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_servers import RedisClusterServers, RedisServer


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.cleanup()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers().start()
    try:
        yield servers
    finally:
        servers.cleanup()
