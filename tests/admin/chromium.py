"""Run Debian's headless Chromium against the dashboard: dump the DOM after its scripts ran,
or take a screenshot. Each run gets a fresh profile and its whole process group is killed."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
)


def chromium_binary() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(
            "chromium is not installed: the dashboard test runs a real headless browser. "
            "Install it with `make system-deps` (Debian package `chromium`); `make test` does.",
            pytrace=False,
        )
    return path


def run_chromium(url: str, *extra: str, virtual_ms: int = 4000, timeout: float = 90) -> str:
    """Load ``url``, let ``virtual_ms`` of page time pass (timers and fetches run), return
    stdout (the DOM with ``--dump-dom``)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-chromium-") as profile:
        cmd = [
            chromium_binary(),
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={virtual_ms}",
            *extra,
            url,
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # renderer and zygote children too
            proc.wait()
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}: {err[-2000:]}"
    return out


def screenshot(url: str, path: Path, *, size: str = "1280,1100", virtual_ms: int = 4000) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    run_chromium(url, f"--screenshot={path}", f"--window-size={size}", virtual_ms=virtual_ms)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"


class Dom(HTMLParser):
    """Elements by id: their attributes and their text (descendants included)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.attrs: dict[str, dict[str, str]] = {}
        self.text: dict[str, str] = {}
        self._open: list[str | None] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        element_id = values.get("id")
        if element_id:
            self.attrs[element_id] = values
            self.text.setdefault(element_id, "")
        if tag not in ("meta", "br", "img", "input", "link"):
            self._open.append(element_id)

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for element_id in self._open:
            if element_id:
                self.text[element_id] += data
