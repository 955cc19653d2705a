"""``kvtier explain REQUEST_ID``: why a request hit or missed, from a running engine.

It asks the engine's admin API (``GET /explain?request_id=``), so it works against anything
that runs one: vLLM with the connector and ``internal_api_server_enabled: true`` in
``kv_connector_extra_config``, ``kvtier server`` with it on (one admin API per model; the URL
is in its log), ``kvtier serve-admin``. Nothing restarts, so the engine's recent records are
all there. Without a request id it lists the recent requests (``GET /requests``).

Prints one line per run of chunks (a hit tier, or why they missed), or the record as JSON
with ``--json``. Exit 0 when found; 1 when the engine answered "no such request" or could not
be reached (the message says which), or when the reader stopped early (``| head``: quietly).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

DEFAULT_ADMIN = "http://127.0.0.1:6999"  # internal_api_server_host / _port_start defaults


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "request_id",
        nargs="?",
        help="the request id vLLM or your client used (vLLM's cmpl-... id works); "
        "without one, the recent requests are listed",
    )
    parser.add_argument(
        "--admin",
        default=os.environ.get("KVTIER_ADMIN_URL", DEFAULT_ADMIN),
        help=f"the engine's admin API (default: $KVTIER_ADMIN_URL, else {DEFAULT_ADMIN}; "
        "the engine logs its URL at start)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("KVTIER_ADMIN_TOKEN"),
        help="bearer token when the engine has admin_token (default: $KVTIER_ADMIN_TOKEN)",
    )
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    parser.add_argument("--limit", type=int, default=20, help="recent requests to list (20)")


def run(args: argparse.Namespace) -> int:
    base = args.admin.rstrip("/")
    if args.request_id is None:
        path = f"/requests?limit={args.limit}"
    else:
        path = f"/explain?request_id={quote(args.request_id, safe='')}"
    try:
        body = _get(base + path, args.token)
    except _Failed as exc:
        print(f"kvtier explain: {exc}", file=sys.stderr)
        return 1
    try:
        if args.json:
            print(json.dumps(body, indent=2))
        elif args.request_id is None:
            for row in body["requests"]:
                print(f"{row['request_id']}: {_counts(row)}")
        else:
            print(_describe(body))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader is gone (``| head`` read its lines): no traceback. What is still
        # buffered goes to /dev/null, or the flush at exit would raise again (Python's
        # documented recipe, "Note on SIGPIPE"; exit 1 as it says).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


class _Failed(Exception):
    pass


def _get(url: str, token: str | None) -> Any:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc).get("error", exc.reason)
        except ValueError:
            message = exc.reason
        raise _Failed(f"{url}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Failed(
            f"no admin API at {url} ({reason}): start the engine with "
            "internal_api_server_enabled: true (in vLLM, in kv_connector_extra_config) and "
            "pass the URL it logs with --admin"
        ) from None


def _describe(record: dict[str, Any]) -> str:
    lines = [
        f"request {record['request_id']}: {_counts(record)} ({record['lookups']} lookups, "
        f"chunks of {record['chunk_size']} tokens)"
    ]
    if "keyed_by" in record:
        lines.append(f"  keyed by {record['keyed_by']}")
    runs: list[list[Any]] = []  # [first, last, start, end, what, detail]
    for row in record["chunks"]:
        what = row.get("tier") if row["found"] else f"miss: {row.get('reason')}"
        detail = row.get("detail", "")
        if runs and runs[-1][4:] == [what, detail] and runs[-1][1] == row["index"] - 1:
            runs[-1][1], runs[-1][3] = row["index"], row["end"]
        else:
            runs.append([row["index"], row["index"], row["start"], row["end"], what, detail])
    for first, last, start, end, what, detail in runs:
        chunks = f"chunk {first}" if first == last else f"chunks {first}-{last}"
        lines.append(
            f"  {chunks} (tokens {start}-{end}): {what}" + (f" ({detail})" if detail else "")
        )
    return "\n".join(lines)


def _counts(record: dict[str, Any]) -> str:
    """A request's tokens as the counters name them: found, loaded, unused (once ended)."""
    unused = f", {record['unused_tokens']} unused" if "unused_tokens" in record else ""
    return (
        f"{record['found_tokens']} of {record['prompt_tokens']} prompt tokens found, "
        f"{record['loaded_tokens']} loaded{unused}"
    )
