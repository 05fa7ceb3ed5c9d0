"""Every relative link in the README and docs/ points at a file that exists (and at a heading
that exists, for ``#anchor`` links), so a renamed page or heading fails the normal test run,
not only ``mkdocs build --strict`` (which needs the docs extra and sees only docs/)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

# [text](target) and ![alt](target), with an optional "title"; reference definitions [x]: target.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s|$)", re.MULTILINE)
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")


def prose_lines(path: Path) -> list[str]:
    """The lines of ``path`` outside fenced code blocks, inline code spans blanked."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        lines.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub (and mkdocs.yml's ``pymdownx.slugs.slugify(case="lower")``) gives a
    heading: markup dropped, lower case, punctuation removed, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every ``#anchor`` of the page at ``path`` (duplicate headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in ``path`` that is not a URL or a mail address."""
    links = []
    for number, line in enumerate(prose_lines(path), start=1):
        for target in INLINE_LINK.findall(line) + REFERENCE_DEF.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            links.append((number, target))
    return links


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of ``path``, one line each (empty: nothing); paths
    in the messages are relative to ``root``."""
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: ({target})"
        if not dest.exists():
            problems.append(f"{where} {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} {dest.relative_to(root)} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(page: Path) -> None:
    assert broken_links(page) == []


def test_the_checker_finds_links_and_catches_broken_ones(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Logging: CSV & W&B\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n"
        "[ok](other.md) [ok](other.md#logging-csv--wb) [ok](#title) [web](https://x.org/a.md)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[ref]: ./missing_too.md\n"
    )
    problems = [problem.split(": (", 1)[1] for problem in broken_links(page, tmp_path)]
    assert problems == [
        "missing.md) missing.md does not exist",
        "other.md#nope) other.md has no heading #nope",
        "./missing_too.md) ./missing_too.md does not exist",
    ]


def test_every_page_of_docs_is_in_the_mkdocs_nav() -> None:
    """A new page in docs/ must be added to mkdocs.yml's nav (else ``mkdocs build --strict``
    fails in CI: said here first, without mkdocs)."""
    nav = set(
        re.findall(
            r"^\s*-\s+(?:[^:\n]+:\s+)?(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M
        )
    )
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert sorted(pages - nav) == [], "add these pages to the nav of mkdocs.yml"
    assert sorted(nav - pages) == [], "mkdocs.yml's nav names pages that do not exist"


def test_the_api_reference_renders_every_public_name() -> None:
    """Every name of ``ringtrain.__all__`` has a ``::: ringtrain.NAME`` block in docs/api/ (read
    from the source: nothing is imported)."""
    import ast

    tree = ast.parse((ROOT / "src" / "ringtrain" / "__init__.py").read_text())
    public = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    )
    rendered = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        rendered.update(re.findall(r"^::: ringtrain\.(\w+)\s*$", page.read_text(), re.M))
    missing = sorted(set(public) - rendered - {"__version__"})
    assert missing == [], "add a ::: ringtrain.NAME block to a page of docs/api/ for each"


def test_the_docs_pages_that_source_code_names_exist() -> None:
    """Docstrings and error messages send users to ``docs/NAME.md``: each such page exists."""
    named = set()
    for path in (ROOT / "src").rglob("*.py"):
        for page in re.findall(r"docs/[\w./-]+?\.md", path.read_text(encoding="utf-8")):
            if not (ROOT / page).exists():
                named.add(f"{path.relative_to(ROOT)}: {page}")
    assert sorted(named) == []
