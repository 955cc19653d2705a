"""The socket directory check judges a symbolic link by who made it, not by where it points
(the server-level behaviour, a squatted default stepped around, is in
tests/server/test_local_trust.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier import local_sockets
from kvtier.errors import StateError
from tests.hosts import needs_root

NOBODY = 65534  # another local user


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


@needs_root
def test_another_users_link_to_a_directory_of_ours_is_refused(tmp_path: Path) -> None:
    """$TMPDIR/kvtier-<uid> -> a 0700 directory of ours, made by another user: everything
    about the target passes, but the other user can re-point the link at any time."""
    ours = private_dir(tmp_path / "ours")
    link = tmp_path / f"kvtier-{os.geteuid()}"
    link.symlink_to(ours)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(StateError, match="symbolic link made by uid 65534"):
        local_sockets.private_directory(str(link), closed=True)
    with pytest.raises(StateError, match="symbolic link"):
        local_sockets.private_directory(str(link) + "/", closed=True)
    # The default directory steps aside to a private one of its own, not to the link's target.
    moved = local_sockets.claim_directory(str(link))
    assert moved.startswith(str(link) + ".") and moved != str(ours)
    assert os.readlink(link) == str(ours)  # the squatter's link is left as it was


@needs_root
def test_a_root_made_link_counts_only_for_an_operators_path(tmp_path: Path) -> None:
    """/var/run -> /run: a link root made is followed where root may own the directory."""
    target = private_dir(tmp_path / "run")
    link = tmp_path / "var-run"
    link.symlink_to(target)
    os.lchown(link, 0, 0)
    local_sockets.private_directory(str(link), root_owned_ok=True)


def test_our_own_link_to_our_private_directory_is_followed(tmp_path: Path) -> None:
    target = private_dir(tmp_path / "target")
    link = tmp_path / "link"
    link.symlink_to(target)
    local_sockets.private_directory(str(link), closed=True)


def test_our_own_link_to_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "open"
    target.mkdir()
    target.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(StateError, match="mode 0777"):
        local_sockets.private_directory(str(link))


def test_a_file_or_a_link_to_a_file_is_not_a_directory(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("")
    link = tmp_path / "link"
    link.symlink_to(regular)
    for path in (regular, link):
        with pytest.raises(StateError, match="not a directory"):
            local_sockets.private_directory(str(path), create=False)


def test_a_directory_without_read_permission_is_still_checked(tmp_path: Path) -> None:
    """The mode is read from an O_PATH descriptor: a 0300 directory needs no read bit."""
    locked = tmp_path / "wx-only"
    locked.mkdir(mode=0o300)
    locked.chmod(0o300)
    local_sockets.private_directory(str(locked), closed=True)
