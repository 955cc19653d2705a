"""``kvtier server --help`` tells the truth about its defaults: the socket path the server
really uses when none is given, and the CPU tier a model gets with no config."""

from __future__ import annotations

import os
import re
import tempfile

import pytest

from kvtier.cli.main import main
from kvtier.server.endpoint import socket_path


def _help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(["server", "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_server_help_states_the_default_socket_path_the_server_uses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    text = _help(capsys)
    match = re.search(r"else \$XDG_RUNTIME_DIR/kvtier.sock, else (\S+) \(/tmp\)(\S+?)\)", text)
    assert match, text
    variable, rest = match.groups()  # "$TMPDIR", "/kvtier-<uid>/kvtier.sock"
    runtime = str(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    assert socket_path() == os.path.join(runtime, "kvtier.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv(variable.lstrip("$"), runtime)
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads $TMPDIR again
    said = runtime + rest.replace("<uid>", str(os.geteuid()))
    assert socket_path() == said


def test_server_help_states_the_cpu_tier_a_model_gets_with_no_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "max_local_cpu_size unset: each model gets a tenth of this machine's memory" in (
        _help(capsys)
    )
