"""``kvtier``: the command-line entry point.

Each command lives in its own module with ``add_parser(subparsers)`` and a ``run(args)``
returning an exit code; :data:`COMMANDS` lists them, imported only when used, so a command
whose optional pieces are missing cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import io
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from kvtier.errors import KVTierError

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "check-config": ("kvtier.cli.check_config", "print the resolved config and derived sizes"),
    "bench": ("kvtier.cli.bench", "measure a tier against its physical baseline"),
    "demo": ("kvtier.cli.demo", "multi-round chat workload: TTFT with and without kvtier"),
    "pd-demo": ("kvtier.cli.pd_demo", "prefill/decode disaggregation between two processes"),
    "pd-proxy": (
        "kvtier.cli.pd_proxy",
        "vllm-router in PD mode in front of kvtier prefillers and decoders",
    ),
    "explain": ("kvtier.cli.explain", "why a request hit or missed, from a running engine"),
    "serve-admin": ("kvtier.cli.serve_admin", "run an engine with the admin API and dashboard"),
    "server": ("kvtier.cli.server", "one cache per host: the kvtier server on a Unix socket"),
    "tiny-model": (
        "kvtier.cli.tiny_model",
        "write a small random-weight checkpoint for vLLM and print the command to serve it",
    ),
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def version() -> str:
    """The installed distribution's version, else the source tree's (``PYTHONPATH=src``)."""
    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _log_level_option(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        # On a subcommand SUPPRESS keeps the value given before it (kvtier --log-level X cmd).
        default=argparse.SUPPRESS if default is None else default,
        metavar="LEVEL",
        help="log level of kvtier's messages on stderr: "
        + ", ".join(LOG_LEVELS)
        + " (default: $KVTIER_LOG_LEVEL, else WARNING; INFO for `kvtier server`); "
        "accepted before or after the command",
    )


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with ``only``, that command's module alone is imported
    (the others are listed by name and help): `kvtier check-config` must not pay for the
    torch that `kvtier demo` imports."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="A tiered KV-cache layer for LLM inference."
    )
    parser.add_argument("--version", action="version", version=f"kvtier {version()}")
    _log_level_option(parser, os.environ.get("KVTIER_LOG_LEVEL", "WARNING").upper())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith(module_name):
                raise
            continue  # not built in this tree
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_parser(command)
        _log_level_option(command, None)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(_command_named(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    # Progress and results reach a pipe or a file as they happen, not in 8 KiB blocks.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args._run(args))
    except KVTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # 130 alone read as a crash or a hang ended by the shell: say what happened.
        print(f"kvtier {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _command_named(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs (the first word that is one), or None (``--help``)."""
    return next((word for word in argv if word in COMMANDS), None)


if __name__ == "__main__":
    sys.exit(main())
