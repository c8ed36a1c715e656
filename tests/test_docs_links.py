"""Every link of README.md, CHANGELOG.md and docs/*.md resolves: the file exists, the #anchor is a heading
of it (as GitHub and the docs site both spell anchors), and the target is a page of the docs site.

``make docs`` (``mkdocs build --strict``) checks the same on the built site; this test needs no mkdocs.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE_ROOT_PAGES = ("README.md", "CHANGELOG.md")
"""Pages outside docs/ that the site includes (``mkdocs_hooks.py``)."""
PAGES = [*(ROOT / name for name in SITE_ROOT_PAGES), *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def prose_lines(text: str, *, keep_code: bool = False) -> list[tuple[int, str]]:
    """The lines outside code fences, numbered from 1, with inline code removed unless ``keep_code``."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening[1]
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None:
            out.append((number, line if keep_code else re.sub(r"`[^`]*`", "``", line)))
    return out


def _heading_text(raw: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", raw)  # a code span's text stays
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays
    return re.sub(r"<[^>]+>", "", text)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", _heading_text(heading).strip().lower()).replace(" ", "-")


def site_slug(heading: str) -> str:
    """The anchor the docs site gives a heading (Python-Markdown's toc slugify)."""
    text = unicodedata.normalize("NFKD", _heading_text(heading))
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    """The anchors both GitHub and the site give the headings of ``path``."""
    headings = [
        m[1] for _, line in prose_lines(path.read_text(), keep_code=True) if (m := _HEADING.match(line))
    ]
    return {github_slug(h) for h in headings} & {site_slug(h) for h in headings}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each link of ``path`` (a page of the repository at ``root``) that does not resolve, with its line and
    why."""
    problems = []
    for number, line in prose_lines(path.read_text()):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not resolved.exists():
                problems.append(f"{where}: no such file")
                continue
            in_site = (
                resolved in {root / name for name in SITE_ROOT_PAGES} or (root / "docs") in resolved.parents
            )
            if not in_site:
                problems.append(
                    f"{where}: not a page of the docs site (link to docs/, README.md or "
                    f"CHANGELOG.md; name other files as `code`)"
                )
            elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_resolves(path):
    assert broken_links(path) == []


def test_the_checker_reports_a_missing_file_a_missing_anchor_and_a_file_outside_the_site(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "README.md").write_text("# Title\n\n## A five-minute `tour`\n\n```sh\n# not a heading\n```\n")
    (tmp_path / "docs" / "PAGE.md").write_text(
        "\n".join(
            [
                "[ok](../README.md#a-five-minute-tour) [here](#local) [file](MISSING.md)",
                "[anchor](../README.md#no-such-heading) [image](../README.md) "
                "[code](../README.md#not-a-heading)",
                "[outside](../pyproject.toml) `[code](NOT_CHECKED.md)`",
                "```text",
                "[fenced](ALSO_NOT.md)",
                "```",
                "## Local",
            ]
        )
    )
    assert broken_links(tmp_path / "docs" / "PAGE.md", tmp_path) == [
        "docs/PAGE.md:1: MISSING.md: no such file",
        "docs/PAGE.md:2: ../README.md#no-such-heading: no heading with anchor #no-such-heading",
        "docs/PAGE.md:2: ../README.md#not-a-heading: no heading with anchor #not-a-heading",
        "docs/PAGE.md:3: ../pyproject.toml: not a page of the docs site (link to docs/, README.md or "
        "CHANGELOG.md; name other files as `code`)",
    ]


def test_slugs_follow_github_and_the_site():
    assert github_slug("3. What a match guarantees") == "3-what-a-match-guarantees"
    assert site_slug("3. What a match guarantees") == "3-what-a-match-guarantees"
    assert github_slug("The override and `pipeline()`") == "the-override-and-pipeline"
    assert github_slug("a - b") == "a---b" and site_slug("a - b") == "a-b"  # such a heading: no anchor
