"""The README a newcomer reads first (issue 58): at most 250 lines, the two commands and the
quick start before any design table, an honest `make test` time with how to rerun one failed
test, `source .venv/bin/activate` before the first `kvtier` command, a short figures table
whose full version lives in docs/benchmarks.md, and links that resolve."""

from __future__ import annotations

import re

from .doc_blocks import ROOT, blocks, section

README = (ROOT / "README.md").read_text()
MAX_LINES = 250


def _headings(text: str) -> list[str]:
    return re.findall(r"^## (.+)$", text, re.M)


def test_the_readme_is_short_and_starts_with_what_to_run() -> None:
    assert len(README.splitlines()) <= MAX_LINES
    headings = _headings(README)
    assert headings[:2] == ["The two commands", "Quick start"], headings
    for kept in ("Features", "Design", "Headline figures", "Config"):
        assert kept in headings
    assert "make demo" in blocks("README.md")[0] and "make test" in blocks("README.md")[0]
    assert "```\n engine" in section("README.md", "## Design")  # the tier diagram


def test_make_test_time_is_honest_and_one_failed_test_can_be_rerun() -> None:
    text = " ".join(section("README.md", "## The two commands").split())
    assert re.search(r"CI measured [\d,]+ s; \d+ min on a loaded host", text)
    assert "`.venv/bin/python -m pytest -n 0 'tests/path::test_name'`" in text


def test_the_environment_is_activated_before_the_first_kvtier_command() -> None:
    first = min(m.start() for m in re.finditer(r"^kvtier ", README, re.M))
    assert 0 <= README.find("source .venv/bin/activate") < first


def test_the_figures_table_is_short_and_links_the_full_one() -> None:
    text = section("README.md", "## Headline figures")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert 3 <= len(rows) <= 10, rows
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    for row in rows[1:]:  # each short row's benchmark is in the full table
        assert row.split(" | ")[0] in benchmarks, row


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_readme_resolves() -> None:
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#([\w-]+))?\)", README):
        path, anchor = target
        page = ROOT / path
        assert page.is_file(), path
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, (path, anchor)
