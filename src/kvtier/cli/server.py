"""``kvtier server``: one cache per host, in the foreground (see docs/server.md).

Fits systemd (``Type=notify`` or ``simple``) and containers: it stays in the foreground, logs
to stderr (INFO unless ``--log-level`` says otherwise), tells systemd when it is ready, and
SIGTERM or SIGINT drains and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
from types import FrameType

from kvtier.config import Config
from kvtier.server import systemd
from kvtier.server.daemon import KVTierServer


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="kvtier or LMCache YAML (default: $KVTIER_CONFIG_FILE, else $LMCACHE_CONFIG_FILE, "
        "else defaults); KVTIER_<KEY> / LMCACHE_<KEY> environment variables apply on top. "
        "max_local_cpu_size unset: each model gets a tenth of this machine's memory, at most "
        "5 GiB",
    )
    parser.add_argument(
        "--socket",
        default=None,
        help="Unix socket path or unix:// URL (default: server_socket, "
        "else $XDG_RUNTIME_DIR/kvtier.sock, else $TMPDIR (/tmp)/kvtier-<uid>/kvtier.sock)",
    )


def run(args: argparse.Namespace) -> int:
    kvtier_log = logging.getLogger("kvtier")
    if logging.getLogger().level > logging.INFO and kvtier_log.level == logging.NOTSET:
        kvtier_log.setLevel(logging.INFO)  # a daemon says what it does unless told not to
    server = KVTierServer(Config.load(args.config), args.socket)

    def stop(signum: int, frame: FrameType | None) -> None:
        logging.getLogger(__name__).info("%s: draining", signal.Signals(signum).name)
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with server:  # opening logs the one "listening" line, with where the admin API will be
        systemd.notify("READY=1")
        server.serve_forever()
        systemd.notify("STOPPING=1")
    return 0
