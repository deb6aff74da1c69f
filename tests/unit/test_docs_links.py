"""Every relative link in README.md and docs/*.md leads somewhere: the file it names exists, and its `#anchor`
matches a heading of that file as GitHub names headings (lower case, punctuation dropped, spaces as hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced and indented code blocks, inline code spans removed."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        out.append(CODE_SPAN.sub("", line))
    return out


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (a repeated heading's second is `name-1`)."""
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} (.+)", line)
        if match:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(page: Path) -> list[str]:
    """`target: why` for each relative link of the page that leads nowhere."""
    broken = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{target}: no file {linked}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading(page):
    assert broken_links(page) == []


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Two words: `code`\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#two-words-code) [self](#page) `[in code](nowhere.md)`\n\n"
                    "    [indented code](nowhere.md)\n\n[gone](missing.md) [no heading](other.md#three)\n")
    assert broken_links(page) == [f"missing.md: no file {tmp_path / 'missing.md'}",
                                  "other.md#three: no heading #three in other.md"]


def test_the_pages_are_the_readme_and_the_docs():
    assert {p.name for p in PAGES} >= {"README.md", "keys.md", "runs.md", "ARCHITECTURE.md"}
