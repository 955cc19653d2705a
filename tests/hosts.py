"""What a test may need from its host, and the one rule for when the host lacks it.

CI (``.ci/run``) runs the suite as root with ``KVTIER_CI=1`` after ``make test`` installed
everything the suite uses (redis-server, chromium, vLLM, nixl, the C extension with
xxhash.h). There a skip means a feature went untested, so under ``KVTIER_CI=1`` every skip is
a failure, except the two kinds below that no host setup can change:

* a test marked ``gpu`` on a host with no CUDA device (``-m gpu`` is how GPUs are lent);
* :func:`not_applicable`: a parameter combination with nothing to check (say, comparing
  the Python hasher with itself), on every host alike.

Root is one rule too. A test that acts as another user (``chown`` to nobody, ``setuid`` in a
child, ``lchown`` a link) carries :data:`needs_root`: it runs as root, is skipped with that
reason elsewhere, and, as any skip, fails under ``KVTIER_CI=1``. No test today fails *because*
it runs as root (root still meets RLIMIT_FSIZE and SO_PEERCRED, which the suite uses instead of
permission bits); one that did would carry a mark here saying why, never an ad-hoc check.

The hooks below run as a plugin: ``tests/conftest.py`` imports them, and
``tests/test_hosts.py`` loads this module with ``-p tests.hosts`` into a pytest of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

NOT_APPLICABLE = "not applicable: "
ROOT_REASON = "needs root to act as another user (chown, setuid); CI runs as root"

needs_root = pytest.mark.needs_root


def in_ci() -> bool:
    """Read at each use, not at import: a test's own pytest may set or clear it."""
    return os.environ.get("KVTIER_CI") == "1"


def not_applicable(reason: str) -> None:
    """Skip a parameter combination that has nothing to check on any host (allowed in CI)."""
    pytest.skip(NOT_APPLICABLE + reason)


def cuda_available() -> bool:
    import torch  # lazily: a plugin that imports torch at load slows every pytest start

    return bool(torch.cuda.is_available())


def ci_skip_problem(reason: str, *, gpu_marked: bool) -> str | None:
    """Why a skip with ``reason`` must fail under ``KVTIER_CI=1``, None if it may stand."""
    if reason.startswith(NOT_APPLICABLE):
        return None
    if gpu_marked and not cuda_available():
        return None
    return (
        f"skipped under KVTIER_CI=1 ({reason!r}): CI installs everything the suite uses and "
        "runs as root, so this skip would hide an untested feature. Install what it needs "
        "(make test), or, if nothing to check exists on any host, call "
        "tests.hosts.not_applicable(reason)"
    )


def skip_reason(longrepr: object) -> str:
    """The reason pytest recorded for a skip (a (path, line, 'Skipped: why') triple)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"needs_root: {ROOT_REASON}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_root") is not None and os.geteuid() != 0:
        pytest.skip(ROOT_REASON)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    gpu_marked = item.get_closest_marker("gpu") is not None
    problem = ci_skip_problem(skip_reason(report.longrepr), gpu_marked=gpu_marked)
    if problem is not None:
        report.outcome = "failed"
        report.longrepr = problem


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module skipped whole (``importorskip`` at import, ``allow_module_level``)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not (in_ci() and report.skipped):
        return
    problem = ci_skip_problem(skip_reason(report.longrepr), gpu_marked=False)
    if problem is not None:
        report.outcome = "failed"
        report.longrepr = problem
