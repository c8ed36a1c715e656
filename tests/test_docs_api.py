"""The API page of the docs site (docs/api.md, rendered by mkdocstrings through ``mkdocs_hooks.py``): built
with ``mkdocs build --strict`` as ``make docs`` builds it, grouped by what a user does, every option of
``register_generic_pass`` documented, the docstrings' Sphinx roles rendered as links or code (none left
raw), the building blocks left out, and every public name accounted for.

The ``docs`` extra is part of ``make venv``, so ``make test`` runs these (skipped without mkdocs). The build
takes about 10 s; ``make docs`` runs these tests on the site it built (``DOCS_SITE=site``).
"""

from __future__ import annotations

import html
import importlib.util
import inspect
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pattern_infra

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs", reason="the docs extra is not installed (make docs installs it)")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed (make docs)")

GROUPS = {
    "register-a-pass": [
        "register_generic_pass",
        "register_graph_pass",
        "PassContainer",
        "pipeline",
        "override",
    ],
    "write-a-pattern": ["Pattern", "pattern_program", "one_of", "optional", "ConstRule", "predicates"],
    "find-and-explain": ["find_matches", "explain", "explain_in_conversion", "trace", "suggest"],
    "verify": ["verify_pass", "evaluate", "assert_programs_equivalent", "prove_equivalent"],
    "the-command-line": [],
    "pytorch": ["pattern_from_torch", "register_torch_rewrite", "check_torch_rewrite"],
    "errors": ["PatternInfraError", "PatternDefinitionError", "PassRegistrationError", "PassExecutionError"],
}
"""The page's groups (their anchors) and names each must document."""
LEFT_OUT = ["Matcher", "CompiledPattern", "compile_pattern", "SubPass", "GenericSweep", "fuse_one_block"]
"""Building blocks the page names without documenting."""
RAW_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):")


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks_under_test", ROOT / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


@pytest.fixture(scope="module")
def api_page(tmp_path_factory) -> str:
    """The built API page's article: the docs site built once with ``--strict``, or the site ``make docs``
    has just built (``DOCS_SITE=site``)."""
    if os.environ.get("DOCS_SITE"):
        site = ROOT / os.environ["DOCS_SITE"]
    else:
        site = tmp_path_factory.mktemp("site")
        env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
        done = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    page = (site / "api" / "index.html").read_text()
    return page[page.index("<article") : page.index("</article>")]


def _section(page: str, anchor: str) -> str:
    """The HTML from the heading with id ``anchor`` to the next heading of its level or above."""
    start = page.index(f'id="{anchor}"')
    level = page.rfind("<h", 0, start)
    tag = page[level : level + 3]
    ends = [page.find(f"<h{k}", start) for k in range(2, int(tag[2]) + 1)]
    ends = [e for e in ends if e != -1]
    return page[start : min(ends) if ends else len(page)]


def _heading_ids(page: str) -> list[str]:
    return re.findall(r'<h[2-6] id="([^"]+)"', page)


def test_no_sphinx_role_is_left_raw(api_page):
    text = _text(api_page)
    raw = sorted({text[max(0, m.start() - 30) : m.end() + 30] for m in RAW_ROLE.finditer(text)})
    assert raw == [], f"raw Sphinx roles on the API page: {raw}"
    assert "<autoref" not in api_page  # every cross-reference was resolved into a link or plain code


def test_the_page_is_grouped_by_what_a_user_does(api_page):
    ids = _heading_ids(api_page)
    groups = [i for i in ids if i in GROUPS]
    assert groups == list(GROUPS), f"the page's groups, in order: {groups}"
    for group, names in GROUPS.items():
        section = _section(api_page, group)
        for name in names:
            assert re.search(rf'id="pattern_infra\.(?:[\w.]+\.)?{name}"', section), (
                f"{name} not under {group}"
            )
    assert 'href="../CLI/"' in _section(api_page, "the-command-line")


def test_internals_are_left_out(api_page):
    ids = _heading_ids(api_page)
    for name in LEFT_OUT:
        assert not [i for i in ids if re.fullmatch(rf"pattern_infra\.(?:[\w.]+\.)?{name}(?:\.\w+)?", i)], name
        assert f"<code>{name}</code>" in _section(api_page, "building-blocks")
    assert not [i for i in ids if i.endswith(".hops") or ".Matcher." in i]
    # a class shows the members a user reads, not the machinery (PassContainer.add, .apply, .record)
    container = [i for i in ids if i.startswith("pattern_infra.PassContainer.")]
    assert "pattern_infra.PassContainer.stats" in container
    assert not {"pattern_infra.PassContainer.add", "pattern_infra.PassContainer.record"} & set(container)


def test_register_generic_pass_documents_every_option(api_page):
    section = _section(api_page, "pattern_infra.register_generic_pass")
    documented = set(re.findall(r"(?:<td>\s*|<b>)<code>(\w+)</code>", section))  # table or list style
    taken = set(inspect.signature(pattern_infra.register_generic_pass).parameters)
    assert taken - documented == set(), f"undocumented parameters: {sorted(taken - documented)}"
    assert {"constants", "alternatives", "commutative", "fanout", "equivalences", "const_rules"} <= documented
    text = _text(section)
    # what var_constraints may return, as the driver reads it (pattern_infra.rewriting.subpass)
    for spelling in ['(False, "reason")', "a string, the reason itself", "numpy.True_", "None"]:
        assert spelling in text, spelling
    assert "-> bool" not in text
    # the roles became links to the entries they name
    for target in ["pattern_infra.PassContainer", "pattern_infra.find_matches", "pattern_infra.ConstRule"]:
        assert f'href="#{target}"' in section, target


def test_roles_become_links_or_code():
    hooks = _hooks()
    assert hooks.markdown_docstring("see :func:`~pattern_infra.find_matches`.") == (
        'see <autoref identifier="pattern_infra.find_matches" optional><code>find_matches</code></autoref>.'
    )
    assert hooks.markdown_docstring(":class:`pattern_infra.Pattern`") == (
        '<autoref identifier="pattern_infra.Pattern" optional><code>pattern_infra.Pattern</code></autoref>'
    )
    # outside the project, or marked with "!": code, no link
    assert hooks.markdown_docstring("seeded by :func:`torch.manual_seed`") == "seeded by `torch.manual_seed`"
    assert hooks.markdown_docstring(":func:`!pattern_infra.trace`") == "`pattern_infra.trace`"
    # a title of its own; a reStructuredText literal block's "::" becomes a colon
    assert hooks.markdown_docstring(":mod:`the language <pattern_infra.language>`") == (
        '<autoref identifier="pattern_infra.language" optional><code>the language</code></autoref>'
    )
    assert hooks.markdown_docstring("combine them::\n\n    a and b\n") == "combine them:\n\n    a and b\n"
    assert hooks.markdown_docstring("a::b and c::") == "a::b and c::"  # a pass id, and no block after


def test_a_public_name_the_page_forgets_warns(caplog):
    hooks = _hooks()
    page = (ROOT / "docs" / "api.md").read_text()
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.api"):
        hooks.api_markdown(page)
    assert caplog.records == []
    forgot = page.replace("::: pattern_infra.one_of\n", "")
    assert forgot != page
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.api"):
        hooks.api_markdown(forgot)
    assert [r.getMessage() for r in caplog.records] == [
        "docs/api.md: pattern_infra.one_of is public (pattern_infra.__all__) but the page neither documents "
        "it ('::: pattern_infra.one_of' in its group) nor names it."
    ]
