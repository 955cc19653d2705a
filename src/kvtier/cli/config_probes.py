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
``max_local_cpu_size`` (and a PD receiver's ``pd_buffer_size``)
    at most this machine's memory, or its cgroup's limit where lower, as the engine refuses
    at start (:func:`kvtier.validation.check_fits_in_memory`); the checked line also says
    when it is more than is available now (:func:`probe_host_memory`).
``remote_url`` of ``s3://``
    list the prefix, put and delete a probe object (:mod:`kvtier.cli.probes_s3`).
``p2p_peers``
    each peer's handshake with ``p2p_auth_token`` (:mod:`kvtier.cli.probes_p2p`).

The probes that wait on the network (Redis, S3, the peers) run at once, each bounded by its
own deadline of at most :data:`NETWORK_TIMEOUT_S`, so one run is over within about that
whatever is down.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier import host_memory
from kvtier.cli.probes_p2p import probe_p2p_peers
from kvtier.cli.probes_s3 import describe_s3, probe_s3, s3_client_installed
from kvtier.config import Config
from kvtier.config.local_disk import parse_local_disk
from kvtier.config.remote_url import REDIS_SCHEMES, parse_remote_url
from kvtier.config.sizes import format_size
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from redis import Redis

Found = list[tuple[str, ConfigError | None]]

REDIS_TIMEOUT_S = 2.0  # a reachable Redis answers PING in milliseconds, even loaded
# An S3 answers a listing, a small PUT and a DELETE in well under a second, and a kvtier peer
# a handshake in milliseconds; a bound for each, so that one run ends within about this.
NETWORK_TIMEOUT_S = 3.0


def probe_all(config: Config, skip: frozenset[str] = frozenset()) -> Found:
    """(what was tried, its error or None) for each probe the config calls for, but none of
    a key in ``skip`` (one that failed at load: its value there is not the one given)."""
    found: Found = []
    if config.local_disk and "local_disk" not in skip:
        where = parse_local_disk(config.local_disk)
        found.append((f"local_disk: write+fsync+delete in {where}", probe_disk_directory(where)))
    found += probe_host_memory(config, skip)
    jobs = _network_probes(config, skip)
    results: list[Found | None] = [None] * len(jobs)

    def run(i: int) -> None:
        results[i] = jobs[i][1]()

    threads = [
        threading.Thread(target=run, args=(i,), name=f"kvtier-check-config {what}", daemon=True)
        for i, (what, _) in enumerate(jobs)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + NETWORK_TIMEOUT_S + 1.0  # each probe keeps its own
    for (what, _), thread, i in zip(jobs, threads, range(len(jobs)), strict=True):
        thread.join(max(0.0, deadline - time.monotonic()))
        done = results[i]
        if done is None:  # its own deadline did not hold: say so rather than wait
            done = [(what, ConfigError(what.split(":", 1)[0], "(probe)", "an answer in time"))]
        found += done
    return found


def _network_probes(config: Config, skip: frozenset[str]) -> list[tuple[str, Callable[[], Found]]]:
    """(what, the probe) for each probe that waits on the network: run at once."""
    jobs: list[tuple[str, Callable[[], Found]]] = []
    url = config.remote_url
    if url and "remote_url" not in skip:
        if is_redis_url(url):
            timeout = min(REDIS_TIMEOUT_S, config.blocking_timeout_secs)
            what = f"remote_url: PING {parse_remote_url(url).describe()}"
            jobs.append((what, lambda: [(what, probe_redis(url, timeout))]))
        elif url.split("://", 1)[0].lower() == "s3" and s3_client_installed():
            s3_timeout = min(NETWORK_TIMEOUT_S, config.blocking_timeout_secs)
            s3_what = f"remote_url: list+put+delete in {describe_s3(config)}"
            jobs.append((s3_what, lambda: [(s3_what, probe_s3(config, s3_timeout))]))
    if config.p2p_peers and not {"p2p_peers", "p2p_auth_token"} & skip:
        p2p_timeout = min(NETWORK_TIMEOUT_S, config.blocking_timeout_secs)
        jobs.append(("p2p_peers: handshakes", lambda: probe_p2p_peers(config, p2p_timeout)))
    return jobs


def probe_host_memory(config: Config, skip: frozenset[str] = frozenset()) -> Found:
    """The host memory the config asks for against this machine's: above its total (or its
    cgroup's limit) the engine refuses to start, so it is an error here, naming the key, the
    value and the total. Above what is available now it may still start (memory is freed, a
    page cache shrinks), so that is said on the checked line, not counted as a problem."""
    total, available = machine_memory()
    if total is None:
        return []
    asked = [("max_local_cpu_size", config.max_local_cpu_size)]
    pd_host = config.enable_pd and config.pd_role == "receiver"
    if pd_host and config.pd_buffer_size is not None:
        asked.append(("pd_buffer_size", config.pd_buffer_size))
    found: Found = []
    running = 0
    for key, nbytes in asked:
        running += nbytes
        if key in skip:
            continue
        what = f"{key}: {format_size(nbytes)} of host memory"
        if running > total:
            with_cpu = " with max_local_cpu_size's" if running != nbytes else ""
            now = "" if available is None else f" ({format_size(available)} available now)"
            found.append(
                (
                    what,
                    ConfigError(
                        key,
                        format_size(nbytes),
                        f"at most this machine's memory{with_cpu}: {format_size(total)} in "
                        f"all{now}; the engine refuses a size above it at start",
                    ),
                )
            )
        elif available is not None and running > available:
            found.append((f"{what} (more than the {format_size(available)} available now)", None))
        else:
            found.append((f"{what} (of {format_size(total)})", None))
    return found


def machine_memory() -> tuple[int | None, int | None]:
    """(the most this process may use, available now) bytes: :mod:`kvtier.host_memory`'s
    readings, the engine's and the server's own."""
    return host_memory.machine_memory(), host_memory.available_memory()


def is_redis_url(url: str) -> bool:
    """A URL of the Redis grammar (else a scheme some registered tier owns: not probed)."""
    return url.split("://", 1)[0].lower() in REDIS_SCHEMES


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
