"""A ``kvtier server`` started as the child of a bench or a test, which dies with its parent.

A server run by hand or by systemd lives on its own. One that ``kvtier bench server``,
``python -m benchmarks serve`` or a test starts belongs to that run: when the run is killed
(a timeout's SIGTERM or SIGKILL, a cancelled CI job), its server must go too, not keep its
socket, its shared pages and a core until someone finds it. The run's own ``finally`` cannot
do it: SIGKILL runs none.

How (Linux): between fork and exec the child asks the kernel for SIGTERM at its parent's death
(``prctl(PR_SET_PDEATHSIG)``, kept across exec), and the server drains and exits on SIGTERM
as it does under systemd (``kvtier.cli.server``). A parent that died before that request (the
moment between fork and prctl) is seen at once: the child's parent is then someone else, and
it exits instead of starting the server. Elsewhere nothing is asked, and the caller's own stop
is all there is.

The kernel's "parent" is the thread that forked, not the process: a server spawned from a
thread that then ends is sent SIGTERM with it. Spawn from a thread that lives as long as the
server (every caller here spawns from its main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import IO

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_File = int | IO[bytes] | None


def server_command(socket_path: str, args: Sequence[str] = ()) -> list[str]:
    """The command a user runs, with this Python: ``kvtier server [args] --socket PATH``."""
    return [sys.executable, "-m", "kvtier.cli.main", "server", *args, "--socket", socket_path]


def spawn_server(
    socket_path: str,
    *,
    env: dict[str, str],
    stdout: _File = None,
    stderr: _File = None,
    start_new_session: bool = False,
    args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``kvtier server`` on ``socket_path`` in a child process that dies with this one (see
    the module docstring). It returns at once: waiting for the socket is the caller's."""
    return subprocess.Popen(
        server_command(socket_path, args),
        env=env,
        stdout=stdout,
        stderr=stderr,
        start_new_session=start_new_session,
        preexec_fn=_dies_with(os.getpid()),
    )


def _dies_with(parent: int) -> Callable[[], None] | None:
    """What the child runs before exec: the parent-death request, then the check that the
    parent still lives. None where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return None
    # Looked up here, in the parent: the child, a copy of a threaded process, calls only this
    # one C function and os.getppid between fork and exec (no import, no lock of Python's).
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def request() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took hold
            os._exit(1)

    return request
