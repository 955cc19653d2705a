"""``kvtier check-config``'s probe of an ``s3://`` ``remote_url``: what the s3 tier does first
at engine start, tried now (issue 58, item 2).

Three calls, in the tier's order, stopping at the first that fails::

    list   PREFIX/                      the bucket exists, the key may read it
    put    PREFIX/.kvtier-check-config.PID   the key may write (SeaweedFS creates a missing
                                        bucket on a PUT, so the listing comes first)
    delete PREFIX/.kvtier-check-config.PID   and delete; nothing is left behind

A failure is one :class:`ConfigError` on ``remote_url`` naming the bucket, the endpoint and
what the server said: its S3 error code (``HTTP 404 NoSuchBucket``, ``HTTP 403
SignatureDoesNotMatch``), or that nothing answered. The whole probe runs in a thread of its
own and is over within ``timeout`` seconds whatever the server does: obstore's timeout is
per request, and a server that accepts and never answers would otherwise cost three of them.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import threading

from kvtier.config import Config
from kvtier.errors import ConfigError, KVTierError, TierUnavailable
from kvtier.storage.s3.options import S3Options

_Answer = queue.SimpleQueue[ConfigError | None]


def s3_client_installed() -> bool:
    """obstore is the ``s3`` extra: without it the tier registry names the install step."""
    return importlib.util.find_spec("obstore") is not None


def describe_s3(config: Config) -> str:
    """``s3://bucket/prefix at endpoint`` for the checked line (no secret: none is in it)."""
    try:
        options = S3Options.from_config(config)
    except ConfigError:
        return "s3 (options refused)"
    location = options.location
    return f"s3://{location.bucket}/{location.prefix} at {options.endpoint or 'AWS'}"


def probe_s3(config: Config, timeout: float) -> ConfigError | None:
    """List the prefix, put and delete a probe object; None when all three worked, else an
    error naming the bucket, the endpoint and the S3 error code, ``timeout`` s at the most."""
    try:
        options = S3Options.from_config(config)
    except ConfigError as exc:
        return exc  # the same words the tier would stop vLLM with
    answers: _Answer = queue.SimpleQueue()
    threading.Thread(
        target=_steps, args=(options, timeout, answers), name="kvtier-check-config s3", daemon=True
    ).start()
    try:
        return answers.get(timeout=timeout)
    except queue.Empty:
        where = _where(options)
        return _refused(where, f"no answer within {timeout:g} s (a stalled server or proxy)")


def _steps(options: S3Options, timeout: float, answers: _Answer) -> None:
    from kvtier.storage.s3.client import S3Client  # obstore: only when an s3 URL is given

    location = options.location
    where = _where(options)
    client = S3Client(
        options.endpoint,
        location.bucket,
        options.credentials,
        timeout_s=timeout,
        region=options.region,
    )
    probe = "/".join(p for p in (location.prefix, f".kvtier-check-config.{os.getpid()}") if p)
    step = "list"
    try:
        for _ in client.list(location.prefix):
            break  # one page says the bucket is there and readable
        step = "put"
        client.put(probe, b"kvtier check-config")
        step = "delete"
        client.delete([probe])
    except FileNotFoundError as exc:  # obstore's 404 outside a get: the bucket
        answers.put(_refused(where, f"{step} failed: HTTP 404 ({_first_line(exc)})"))
    except TierUnavailable as exc:
        answers.put(_refused(where, f"{step} failed: nothing answered ({_detail(exc)})"))
    except KVTierError as exc:
        answers.put(_refused(where, f"{step} failed: {_detail(exc)}"))
    except Exception as exc:  # whatever it is, it is this store's answer: lost, it reads as silence
        answers.put(_refused(where, f"{step} failed: {type(exc).__name__}: {_first_line(exc)}"))
    else:
        answers.put(None)


def _where(options: S3Options) -> str:
    endpoint = options.endpoint or f"AWS ({options.region})"
    return f"bucket {options.location.bucket!r} at {endpoint}"


def _refused(where: str, what: str) -> ConfigError:
    return ConfigError(
        "remote_url",
        where,
        f"an S3 bucket this key may list, write and delete in: {what}",
    )


def _detail(exc: BaseException) -> str:
    """The S3 code (``HTTP 403 SignatureDoesNotMatch``) of a translated client error, without
    the ``s3 list kv:`` the client puts before it (the step is named already)."""
    text = _first_line(exc)
    return text.split(": ", 1)[1] if text.startswith("s3 ") and ": " in text else text


def _first_line(exc: BaseException) -> str:
    return str(exc).split("\n", 1)[0]
