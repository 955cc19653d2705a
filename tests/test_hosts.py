"""The one rule of tests/hosts.py, run for real: a pytest of its own (``-p tests.hosts``) over
a few tests that skip in each way, with and without ``KVTIER_CI=1``, as a user that is not root
(when this suite runs as root, as CI does, the inner pytest becomes uid 65534 once configured:
the interpreter may live where that user cannot read, as under /root here), so ``needs_root``
meets a host without root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import hosts

REPO = Path(__file__).resolve().parents[1]

SKIPPING = """
import pytest
from tests import hosts

def test_plain_skip():
    pytest.skip("redis-server is not installed")

@pytest.mark.gpu
def test_gpu_without_cuda():
    pytest.skip("needs CUDA")

@pytest.mark.skipif(True, reason="the C extension was built without xxhash.h")
def test_skipif_mark():
    pass

def test_not_applicable():
    hosts.not_applicable("the Python hasher compared with itself")

@hosts.needs_root
def test_needs_root():
    pass

def test_passes():
    pass
"""

# Loaded last of the inner pytest's plugins: every module pytest itself needs is imported by then.
DROP_ROOT = """
import os
import pytest
import torch  # noqa: F401 (tests.hosts asks it for CUDA: imported while its files are readable)

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
"""

WHOLE_MODULE = """
import pytest
pytest.importorskip("kvtier_no_such_module")

def test_never_collected():
    pass
"""


def run_inner(directory: Path, ci: bool) -> dict[str, tuple[str, str]]:
    """Outcome and message of each test (and of a module that failed to collect)."""
    report = directory / f"report-{ci}.xml"
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_CI"}
    env["PYTHONPATH"] = f"{REPO}:{directory}"
    env["HOME"] = str(directory)
    if ci:
        env["KVTIER_CI"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.hosts", "-p", "drop_root"]
        + ["-p", "no:cacheprovider", "--continue-on-collection-errors"]
        + ["-p", "no:xdist", "-q", f"--junitxml={report}", f"--rootdir={directory}"]
        + ["test_skipping.py", "test_whole_module.py"],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert report.exists(), done.stdout + done.stderr
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name") or case.get("classname") or "?"
        verdict = ("passed", "")
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                verdict = (child.tag, child.get("message") or "")
        outcomes[name] = verdict
    return outcomes


@pytest.fixture(scope="module")
def inner() -> Iterator[dict[bool, dict[str, tuple[str, str]]]]:
    # Straight under the temporary directory, open to uid 65534: pytest's own temporary
    # directories sit under a 0700 pytest-of-<user> (and, under xdist, a level deeper).
    directory = Path(tempfile.mkdtemp(prefix="kvtier-hosts-"))
    try:
        directory.chmod(0o777)
        (directory / "test_skipping.py").write_text(SKIPPING)
        (directory / "test_whole_module.py").write_text(WHOLE_MODULE)
        (directory / "drop_root.py").write_text(DROP_ROOT)
        (directory / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
        yield {ci: run_inner(directory, ci) for ci in (False, True)}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_without_ci_every_skip_stays_a_skip(inner: dict[bool, dict[str, tuple[str, str]]]) -> None:
    outcomes = inner[False]
    skipped = {name for name, (verdict, _) in outcomes.items() if verdict == "skipped"}
    expected = {
        "test_plain_skip",
        "test_skipif_mark",
        "test_not_applicable",
        "test_needs_root",
        "test_whole_module",
        "test_gpu_without_cuda",
    }
    assert skipped == expected, outcomes
    assert outcomes["test_needs_root"][1].endswith(hosts.ROOT_REASON)


def test_under_ci_a_skip_fails_unless_no_host_could_run_it(
    inner: dict[bool, dict[str, tuple[str, str]]],
) -> None:
    outcomes = inner[True]
    failed = {name for name, (verdict, _) in outcomes.items() if verdict in ("failure", "error")}
    assert failed == {
        "test_plain_skip",
        "test_skipif_mark",
        "test_needs_root",
        "test_whole_module",
    }, outcomes
    assert outcomes["test_not_applicable"][0] == "skipped"
    gpu = outcomes["test_gpu_without_cuda"][0]
    assert gpu == ("failure" if hosts.cuda_available() else "skipped")  # a GPU here: run it
    assert outcomes["test_passes"] == ("passed", "")


def test_the_ci_failure_names_the_skip_and_the_way_out() -> None:
    problem = hosts.ci_skip_problem("systemd-analyze is not installed", gpu_marked=False)
    assert problem is not None
    assert "systemd-analyze is not installed" in problem
    assert "make test" in problem and "not_applicable" in problem
    assert hosts.ci_skip_problem(hosts.NOT_APPLICABLE + "x", gpu_marked=False) is None
