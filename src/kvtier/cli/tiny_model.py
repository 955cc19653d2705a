"""``kvtier tiny-model DIR``: a small random-weight checkpoint to point vLLM at, offline.

Every vLLM command in the docs needs ``--model``; on a machine with no network, or before
choosing a real model, there is none. This writes the checkpoint the tests and demos use
(:mod:`kvtier.demo.checkpoint`: seeded random weights, a word-level tokenizer, nothing
downloaded) and prints the vLLM command that serves it with kvtier. The weights are random,
so the text is meaningless; the KV geometry, the loads and the hits are real.

``DIR`` is overwritten only if it is empty, missing, or written by this command before (a
marker file says so): a real model that happens to be there is never replaced.

Where it writes, since the docs' ``/tmp/tiny-llama`` sits in a directory every user can write
(and this may run as root)::

    DIR          created 0755 when missing; else it must be a directory (not a symbolic
                 link, dangling or not: another user chooses where a link points) owned by
                 this user and not writable by group or others, so nobody else can add,
                 swap or link a name in it. Opened once, O_NOFOLLOW; everything after goes
                 through that descriptor, so a path swapped after the check is not followed.
    the marker   must be a regular file: a link named like it proves nothing
    the files    written into a fresh 0700 directory made inside DIR, then renamed into DIR
                 one by one; a rename replaces a link that is there and never writes
                 through it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from kvtier.errors import InputError

MARKER = ".kvtier-tiny-model"
PARTIAL = f"{MARKER}.partial-"  # the staging directory's name, then random hex

# What the printed command adds to vLLM's defaults, each for a reason: the weights are fp32
# (the CPU build has no bf16 kernels on most CPUs); eager mode skips minutes of torch.compile
# for a model this small; 4096 tokens keep vLLM's own KV space (VLLM_CPU_KVCACHE_SPACE, GiB)
# small; one CPU reserved for the CPU build's frontend (VLLM_CPU_NUM_OF_RESERVED_CPU; without
# it decode runs 2-3x slower, docs/vllm.md); the connector config is the demo's, the smallest
# that turns kvtier on, with a CPU tier sized for this model: the 5 GiB default is allocated
# and touched at start, for a model whose whole KV for 4096 tokens is a few MiB.
EXTRA_CONFIG = {"max_local_cpu_size": "1GiB"}


def add_parser(parser: argparse.ArgumentParser) -> None:
    from kvtier.demo.checkpoint import FAMILIES, SIZES

    parser.add_argument("dir", metavar="DIR", help="where to write it (created if missing)")
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default="llama",
        help="transformers/vLLM architecture of the checkpoint (default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        default="tiny",
        help="tiny: 4 layers, hidden 256 (the tests' model); small / medium: hidden 512 / "
        "1024, the shapes of `kvtier demo --model-size` (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")


def run(args: argparse.Namespace) -> int:
    from kvtier.demo.checkpoint import SIZES, write_tiny_model

    given = Path(args.dir).expanduser()
    shape = SIZES[args.size]
    with _target_directory(given) as target, _staging(given, target) as (staging, where):
        write_tiny_model(where, args.family, shape, seed=args.seed)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(MARKER, flags, 0o644, dir_fd=staging), "w") as marker:
            marker.write(f"{args.family} {args.size} seed {args.seed}\n")
        # The marker first: a run stopped halfway leaves a directory a rerun may overwrite.
        names = [MARKER] + sorted(set(os.listdir(staging)) - {MARKER})
        for name in names:
            try:
                os.rename(name, name, src_dir_fd=staging, dst_dir_fd=target)
            except OSError as exc:
                raise InputError(f"tiny-model: cannot write {given / name}: {exc}") from None
    out = given.resolve()  # for the message only: every write above went through descriptors
    print(
        f"wrote a {args.size} {args.family} checkpoint ({shape.num_layers} layers, hidden "
        f"{shape.hidden}, random weights, seed {args.seed}) to {out}"
    )
    print(f"serve it with kvtier: {serve_command(out)}")
    return 0


def serve_command(model: Path) -> str:
    """One line that starts vLLM on ``model`` with kvtier's connector, on both vLLM builds
    (``VLLM_CPU_KVCACHE_SPACE`` only matters to the CPU build; docs/vllm.md says why, and
    why ``--shutdown-timeout``: kvtier's queued writes land before the worker goes)."""
    from kvtier.demo.vllm_runner import CONNECTOR

    connector = {**CONNECTOR, "kv_connector_extra_config": EXTRA_CONFIG}
    return (
        "VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_NUM_OF_RESERVED_CPU=1 "
        "python -m vllm.entrypoints.openai.api_server "
        f"--model {shlex.quote(str(model))} --dtype float32 --enforce-eager "
        f"--max-model-len 4096 --shutdown-timeout 30 --kv-transfer-config "
        + shlex.quote(json.dumps(connector, separators=(",", ":")))
    )


@contextlib.contextmanager
def _target_directory(path: Path) -> Iterator[int]:
    """A descriptor of ``path`` once it is safe to write into (module docstring), created
    when missing; :class:`InputError` naming the path and what is allowed if not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # there already: checked below
            os.mkdir(path, 0o755)
    except OSError as exc:
        raise InputError(f"tiny-model: cannot create the directory {path}: {exc}") from None
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            raise InputError(
                f"tiny-model: {path} is a symbolic link (to {os.readlink(path)!r}); give a "
                "directory of your own, not a link: where a link points is its maker's choice"
            ) from None
        if os.path.lexists(path) and not os.path.isdir(path):
            raise InputError(f"tiny-model: {path} is a file, not a directory") from None
        raise InputError(f"tiny-model: cannot open the directory {path}: {exc}") from None
    try:
        _check_writable(path, fd)
        yield fd
    finally:
        os.close(fd)


def _check_writable(path: Path, fd: int) -> None:
    info = os.fstat(fd)
    me = os.geteuid()
    if info.st_uid != me:
        raise InputError(
            f"tiny-model: {path} is owned by uid {info.st_uid}, not by this user (uid {me}); "
            "another user may have made it to choose what is written where: give a new "
            "directory or one of your own"
        )
    if info.st_mode & 0o022:
        raise InputError(
            f"tiny-model: {path} has mode {stat.S_IMODE(info.st_mode):04o}: others can add "
            f"or swap names in it; give a directory only you can write (chmod go-w {path})"
        )
    # A staging directory a killed run left (_staging) is ours and holds nothing of anyone's.
    if all(name.startswith(PARTIAL) for name in os.listdir(fd)):
        return
    try:
        marker = os.stat(MARKER, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        marker = None
    if marker is None or not stat.S_ISREG(marker.st_mode):
        raise InputError(
            f"tiny-model: {path} holds files that `kvtier tiny-model` did not write (no "
            f"regular file {MARKER} there); give a new or empty directory (nothing there is "
            "overwritten)"
        )


@contextlib.contextmanager
def _staging(path: Path, target: int) -> Iterator[tuple[int, str]]:
    """A fresh 0700 directory inside ``target`` (so renames out of it stay on one file
    system): its descriptor and a path to it for the writers that want a path. Removed with
    whatever is left in it."""
    name = f"{PARTIAL}{secrets.token_hex(8)}"
    try:
        os.mkdir(name, 0o700, dir_fd=target)
        fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=target
        )
    except OSError as exc:
        raise InputError(f"tiny-model: cannot write into {path}: {exc}") from None
    # /proc/self/fd names this very directory, whatever happens to the path above it.
    where = f"/proc/self/fd/{fd}" if os.path.isdir(f"/proc/self/fd/{fd}") else str(path / name)
    try:
        yield fd, where
    except OSError as exc:
        raise InputError(f"tiny-model: cannot write into {path}: {exc}") from None
    finally:
        os.close(fd)
        shutil.rmtree(name, dir_fd=target, ignore_errors=True)
