"""mkdocs hooks: put README.md and CHANGELOG.md on the site, hold the API page to ``pattern_infra.__all__``,
and render the docstrings' Sphinx roles as links.

README.md and CHANGELOG.md live at the repository's root, where GitHub shows them; the site serves them as
``index.md`` and ``changelog.md`` with their links rewritten (``docs/X.md`` -> ``X.md``).

The API page, ``docs/api.md``, is written by hand, grouped by what a user does; each entry is a line
``::: pattern_infra.<name>``. The build warns (and ``--strict`` fails) when a name of
``pattern_infra.__all__`` is neither an entry nor named on the page in backticks (the building blocks the
page mentions without documenting), so the page keeps up with the package. Names are read from
``pattern_infra/__init__.py`` without importing it.

Docstrings keep Sphinx roles (``:func:`explain```, ``:class:`~pattern_infra.language.pattern.Pattern```),
which read well in ``help()``. :class:`SphinxRoles`, a griffe extension that ``mkdocs.yml`` loads, turns each
into a cross-reference when the site documents its target and into plain code otherwise, and makes the
names that ``pattern_infra`` imports on first use (``_ON_USE``) visible as ``pattern_infra.<name>``.
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent
ROOT_PAGES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}
API_PAGE = "api.md"
log = logging.getLogger("mkdocs.hooks.api")


def _root_page(text: str) -> str:
    text = re.sub(r"\]\(docs/", "](", text)
    return re.sub(r"\]\((README|CHANGELOG)\.md", lambda m: f"]({_site_name(m[1])}", text)


def _site_name(stem: str) -> str:
    return {"README": "index.md", "CHANGELOG": "changelog.md"}[stem]


def _package_tree() -> ast.Module:
    return ast.parse((ROOT / "pattern_infra" / "__init__.py").read_text())


def _literal(tree: ast.Module, name: str) -> Any:
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
    raise LookupError(f"pattern_infra/__init__.py has no literal {name}")


_ENTRY = re.compile(r"^::: pattern_infra\.(?P<name>\w+)\s*$", re.MULTILINE)


def api_markdown(markdown: str) -> str:
    """The API page, checked: warns of each public name the page leaves unmentioned and of each entry
    ``pattern_infra.<name>`` that names no public name."""
    public = _literal(_package_tree(), "__all__")
    entries = set(_ENTRY.findall(markdown))
    mentioned = set(re.findall(r"`(\w+)`", markdown))
    for name in public:
        if name not in entries and name not in mentioned:
            log.warning(
                f"docs/{API_PAGE}: pattern_infra.{name} is public (pattern_infra.__all__) but the page "
                f"neither documents it ('::: pattern_infra.{name}' in its group) nor names it."
            )
    for name in sorted(entries - set(public)):
        log.warning(f"docs/{API_PAGE}: '::: pattern_infra.{name}' names no name of pattern_infra.__all__.")
    return markdown


def on_files(files: Files, config: Any) -> Files:
    for site_name, source in ROOT_PAGES.items():
        files.append(File.generated(config, site_name, content=_root_page((ROOT / source).read_text())))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri in ROOT_PAGES:
        return markdown
    if page.file.src_uri == API_PAGE:
        markdown = api_markdown(markdown)
    return re.sub(r"\]\(\.\./(README|CHANGELOG)\.md", lambda m: f"]({_site_name(m[1])}", markdown)


# The docstrings' Sphinx roles -------------------------------------------------------------------------

ROLE = re.compile(r":(?P<role>func|class|meth|attr|mod|data|exc|obj):`(?P<text>[^`]+)`")
"""A Sphinx cross-reference role, ``:func:`name```, ``:class:`~a.b.C```, ``:mod:`title <a.b>```."""
OWN_PACKAGES = ("pattern_infra", "generic_passes")
"""Roles into these become cross-references (links where the site documents the target); others (numpy,
torch, coremltools) stay code."""


def role_markdown(match: re.Match[str], scope: griffe.Object | None) -> str:
    """The markdown of one role found in the docstring of ``scope``: an optional autoref (rendered as a link
    when the target is on the site, as code otherwise) or plain code."""
    text = match["text"].strip()
    titled = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", text)
    title, target = (titled["title"], titled["target"]) if titled else (None, text)
    no_link = target.startswith("!")
    target = target.lstrip("!")
    short = target.startswith("~")
    target = target.lstrip("~")
    shown = title or (target.rsplit(".", 1)[-1] if short else target.lstrip("."))
    code = f"<code>{shown}</code>"
    path = None if no_link else _resolve(target, scope)
    if path is None or path.split(".", 1)[0] not in OWN_PACKAGES:
        return f"`{shown}`"
    return f'<autoref identifier="{path}" optional>{code}</autoref>'


def _resolve(target: str, scope: griffe.Object | None) -> str | None:
    """The full path ``target`` names in the scope of ``scope`` (its imports, its class's members, a
    leading ``.`` for the enclosing package), or ``target`` itself when it names nothing there."""
    if scope is None:
        return target
    if target.startswith("."):
        module = scope if scope.is_module else scope.module
        package = module if module.is_package or module.is_subpackage else module.parent
        return f"{package.path}{target}" if package is not None else None
    first, dot, rest = target.partition(".")
    try:
        resolved = scope.resolve(first)
    except (griffe.NameResolutionError, griffe.AliasResolutionError):
        return target
    return f"{resolved}{dot}{rest}"


def markdown_docstring(text: str, scope: griffe.Object | None = None) -> str:
    """A docstring with its Sphinx roles as cross-references and reStructuredText's ``::`` before a literal
    block as a colon (the indented block stays a code block)."""
    text = ROLE.sub(lambda m: role_markdown(m, scope), text)
    return re.sub(r"(?<=\S)::(?=\n\s*\n)", ":", text)


class SphinxRoles(griffe.Extension):
    """A griffe extension (``mkdocs.yml``: ``extensions``) that rewrites every docstring of ``pattern_infra``
    with :func:`markdown_docstring` and adds the names imported on first use as aliases of the package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "pattern_infra":
            return
        for name, module in _literal(_package_tree(), "_ON_USE").items():
            if name not in pkg.members:
                pkg.set_member(name, griffe.Alias(name, f"pattern_infra.{module}.{name}", parent=pkg))
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = markdown_docstring(obj.docstring.value, obj)


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)
