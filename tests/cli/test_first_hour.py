"""Small things a new user met in their first hour (issue 50, item 10): options without help
and a silent Ctrl-C."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

import kvtier.cli.demo
from kvtier.cli.main import build_parser, main


def options(
    parser: argparse.ArgumentParser, name: str = "kvtier"
) -> Iterator[tuple[str, str, str | None]]:
    """(command, option, help) for every option and positional below ``parser``, --help
    excluded."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from options(subparser, f"{name} {sub}")
        elif not isinstance(action, argparse._HelpAction):
            yield name, "/".join(action.option_strings) or action.dest, action.help


def test_every_option_of_every_command_says_what_it_is_for() -> None:
    missing = [
        f"{command} {option}" for command, option, text in options(build_parser()) if not text
    ]
    assert not missing, missing


def test_pd_demo_requests_and_seed_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["pd-demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--requests REQUESTS requests to send" in text
    assert "--seed SEED seed of the prompts" in text


def test_ctrl_c_exits_130_with_one_line_saying_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvtier.cli.demo, "run", interrupted)
    assert main(["demo"]) == 130
    assert capsys.readouterr().err == "kvtier demo: interrupted (Ctrl-C)\n"
