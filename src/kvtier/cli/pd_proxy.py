"""``kvtier pd-proxy``: vLLM's own router (``vllm-router``) in PD mode, in front of kvtier
prefillers and decoders.

Why a wrapper and not a proxy of our own: kvtier's PD speaks vLLM's standard
``kv_transfer_params`` hand-off, the one NixlConnector uses, so any standard PD proxy drives
it unmodified (vllm-router, vLLM's example proxies)::

    client ──▶ router ──▶ prefiller  body with max_tokens 1, kv_transfer_params
                                     {"do_remote_decode": true, "remote_*": null}
                                     (its chunks reach the decoder's buffer before it answers)
               router ◀── prefiller  kv_transfer_params {"do_remote_prefill": true,
                                     "do_remote_decode": false, "kvtier_transfer_id": id}
               router ──▶ decoder    the client's body + that kv_transfer_params; its answer
                                     (streamed or not) goes back to the client

vllm-router does the HTTP work (limits, timeouts, retries, health checks, several prefillers
and decoders, routing policies); this command only runs it with the flags for that, so the
command line stays the one kvtier documented before. It replaces itself with the router
(``exec``): signals and the exit code are the router's. Anything after ``--`` goes to
vllm-router as it is (e.g. ``-- --policy cache_aware --prometheus-port 29001``).

vllm-router comes with kvtier's ``fleet`` extra (``pip install 'kvtier[fleet]'``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.config.parsers import integer, positive_float
from kvtier.errors import ConfigError, StateError

ROUTER = "vllm-router"


def _checked(parse: Callable[[str, object], Any], key: str) -> Callable[[str], Any]:
    """An argparse type from a config parser: the same rule and message as the config key."""

    def check(raw: str) -> Any:
        try:
            return parse(key, raw)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.allowed) from None

    return check


def base_url(raw: str) -> str:
    """An http(s) URL with a host: what the router can send requests to."""
    parsed = urllib.parse.urlsplit(raw)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not an http:// or https:// URL with a host, e.g. http://127.0.0.1:8100"
        )
    try:
        parsed.port  # noqa: B018  (raises on a port out of range)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{raw!r}: {exc}") from None
    return raw.rstrip("/")


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefiller",
        required=True,
        action="append",
        type=base_url,
        help="a prefiller's base URL, e.g. http://127.0.0.1:8100 (repeat for several)",
    )
    parser.add_argument(
        "--decoder",
        required=True,
        action="append",
        type=base_url,
        help="a decoder's base URL, e.g. http://127.0.0.1:8200 (repeat for several)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the router's listening address")
    parser.add_argument(
        "--port",
        type=_checked(integer(1, 65535), "--port"),
        default=8000,
        help="the router's port, where clients send requests (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=_checked(positive_float(86400.0), "--timeout"),
        default=600.0,
        help="seconds per request (vllm-router's --request-timeout-secs)",
    )
    parser.add_argument(
        "router_args",
        nargs=argparse.REMAINDER,
        help="after --: passed to vllm-router as they are",
    )


def router_binary() -> str:
    """vllm-router next to this Python (its virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / ROUTER
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(ROUTER)
    if found is None:
        raise StateError(
            f"{ROUTER} is not installed next to {sys.executable} or on PATH; "
            "install it with pip install 'kvtier[fleet]'"
        )
    return found


def router_command(args: argparse.Namespace) -> list[str]:
    """The vllm-router command line for ``args``."""
    command = [router_binary(), "--vllm-pd-disaggregation"]
    for url in args.prefiller:
        command += ["--prefill", url]
    for url in args.decoder:
        command += ["--decode", url]
    command += [
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--request-timeout-secs",
        str(max(1, round(args.timeout))),
        # Ask a starting vLLM every second, not every 30 s (the router's default).
        "--worker-startup-check-interval",
        "1",
    ]
    extra = list(args.router_args or [])
    return command + (extra[1:] if extra[:1] == ["--"] else extra)


def run(args: argparse.Namespace) -> int:
    command = router_command(args)
    print("kvtier pd-proxy: exec " + " ".join(command), file=sys.stderr, flush=True)
    os.execv(command[0], command)
    return 0  # not reached: the router replaced this process
