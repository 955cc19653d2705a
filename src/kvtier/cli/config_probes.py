"""What ``kvtier check-config`` tries for real, beyond parsing: the things a config names that
only fail once vLLM has spent a minute starting.

Each probe returns a :class:`ConfigError` naming the key, the value and what would work, or
None when the thing answered. None of them needs torch (check-config answers in about a
second); none leaves anything behind.

``remote_url``
    connect (TLS, ACL user and password as the URL gives them) and PING, every node of a
    cluster URL at once, the whole probe within :data:`REDIS_TIMEOUT_S` (:func:`probe_redis`).
``local_disk``
    write, fsync and delete a probe file in the directory, or in the nearest part of its path
    that exists when the directory is still to be created (the engine creates the rest): a
    read-only filesystem passes ``access(W_OK)`` for root, not a real write.
``pd_buffer_device``
    a PD receiver's buffer is host memory in this build (``PDBuffer.from_config`` refuses
    anything else at engine start; LMCache's 1p1d decoder YAML says ``cuda``).
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

from kvtier.config import Config
from kvtier.config.local_disk import parse_local_disk
from kvtier.config.remote_url import REDIS_SCHEMES, parse_remote_url
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from redis import Redis

REDIS_TIMEOUT_S = 2.0  # a reachable Redis answers PING in milliseconds, even loaded


def probe_all(config: Config) -> list[tuple[str, ConfigError | None]]:
    """(what was tried, its error or None) for each probe the config calls for."""
    found: list[tuple[str, ConfigError | None]] = []
    if config.enable_pd and config.pd_role == "receiver":
        found.append(("pd_buffer_device: host memory", probe_pd_buffer_device(config)))
    if config.local_disk:
        where = parse_local_disk(config.local_disk)
        found.append((f"local_disk: write+fsync+delete in {where}", probe_disk_directory(where)))
    if config.remote_url and is_redis_url(config.remote_url):
        timeout = min(REDIS_TIMEOUT_S, config.blocking_timeout_secs)
        error = probe_redis(config.remote_url, timeout)
        found.append((f"remote_url: PING {parse_remote_url(config.remote_url).describe()}", error))
    return found


def is_redis_url(url: str) -> bool:
    """A URL of the Redis grammar (else a scheme some registered tier owns: not probed)."""
    return url.split("://", 1)[0].lower() in REDIS_SCHEMES


def probe_pd_buffer_device(config: Config) -> ConfigError | None:
    if config.pd_buffer_device not in (None, "cpu"):
        return ConfigError(
            "pd_buffer_device",
            config.pd_buffer_device,
            "'cpu': kvtier's PD receive buffer is host memory (pinned pages the load copies "
            "to the GPU from); vLLM would stop at start on this value",
        )
    return None


def probe_disk_directory(path: str) -> ConfigError | None:
    """``path``: the directory ``local_disk`` names (:func:`parse_local_disk`)."""
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    where = "" if existing == path else f" (it does not exist yet; tried its ancestor {existing})"
    if not os.path.isdir(existing):
        return ConfigError("local_disk", path, f"a directory: {existing} is not a directory")
    probe = os.path.join(existing, f".kvtier-check-config.{os.getpid()}.tmp")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"kvtier")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        reason = "read-only filesystem" if exc.errno == errno.EROFS else exc.strerror
        return ConfigError(
            "local_disk",
            path,
            f"a directory this user can write to: writing a file in {existing} failed "
            f"({reason}){where}",
        )
    return None


def probe_redis(url: str, timeout: float) -> ConfigError | None:
    """PING every place ``url`` names at once; None at the first answer, else an error naming
    each place and what it did, ``timeout`` seconds from the start at the latest.

    ``timeout`` bounds the probe whole, not each step of it: redis-py's own timeouts are per
    socket call (connect, TLS, AUTH, CLIENT SETINFO, PING each get a fresh one) and its
    default client retries ten times with backoff, so one node that accepts and never answers
    took 27 s and a cluster URL of eight such nodes 212 s. So each node's client has retries
    off, runs in a thread of its own, and the caller waits on one deadline for all of them;
    at the deadline the clients are closed (a shut-down socket wakes a thread still waiting).
    """
    import redis  # only when a remote_url is given
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    target = parse_remote_url(url)
    if target.kind == "unix":
        places: list[tuple[str, str | None, int]] = [(target.describe(), None, 0)]
    else:
        places = [(f"{host}:{port}", host, port) for host, port in target.nodes]
    deadline = time.monotonic() + timeout
    answers: queue.SimpleQueue[tuple[str, str | None]] = queue.SimpleQueue()
    clients: list[Redis] = []
    for where, host, port in places:
        client = redis.Redis(
            host=host or "localhost",
            port=port or 6379,
            unix_socket_path=target.path if target.kind == "unix" else None,
            db=0 if target.kind == "cluster" else target.db,
            ssl=target.tls,
            username=target.username,
            password=target.password,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # one try: the deadline is the probe's, not per call
        )
        clients.append(client)
        name = f"kvtier-check-config {where}"
        threading.Thread(
            target=_ping, args=(client, where, answers), name=name, daemon=True
        ).start()
    failures: dict[str, str] = {}
    try:
        while len(failures) < len(places):
            try:
                where, failure = answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if failure is None:
                return None  # a cluster answers through any node it lists
            failures[where] = failure
    finally:
        for client in clients:
            client.close()
    each = [failures.get(where, f"{where}: no answer") for where, _, _ in places]
    return ConfigError(
        "remote_url",
        target.describe(),
        f"a Redis that answers PING within {timeout:g} s ({'; '.join(each)})",
    )


def _ping(client: Redis, where: str, answers: queue.SimpleQueue[tuple[str, str | None]]) -> None:
    """One node's PING, in its own thread: (where, None) on an answer, else what went wrong."""
    try:
        client.ping()
    except Exception as exc:  # whatever it is, it is this node's answer: lost, it reads as silence
        answers.put((where, f"{where}: {type(exc).__name__}: {exc}"))
    else:
        answers.put((where, None))
