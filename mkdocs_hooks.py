"""mkdocs hooks: put README.md, CHANGELOG.md and an API page generated from ``pattern_infra.__all__`` on the site.

README.md and CHANGELOG.md live at the repository's root, where GitHub shows them; the site serves them as
``index.md`` and ``changelog.md`` with their links rewritten (``docs/X.md`` -> ``X.md``). The API page
lists every name of ``pattern_infra.__all__`` as ``pattern_infra.<name>``, read from the package's
``__init__.py`` without importing it (names imported on first use are documented where ``_ON_USE``
says they live), so the page follows the package as its modules move.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent
ROOT_PAGES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}


def _root_page(text: str) -> str:
    text = re.sub(r"\]\(docs/", "](", text)
    return re.sub(r"\]\((README|CHANGELOG)\.md", lambda m: f"]({_site_name(m[1])}", text)


def _site_name(stem: str) -> str:
    return {"README": "index.md", "CHANGELOG": "changelog.md"}[stem]


def _literal(tree: ast.Module, name: str) -> Any:
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
    raise LookupError(f"pattern_infra/__init__.py has no literal {name}")


def api_page() -> str:
    """The API reference: one mkdocstrings entry per name of ``pattern_infra.__all__``."""
    tree = ast.parse((ROOT / "pattern_infra" / "__init__.py").read_text())
    names, on_use = _literal(tree, "__all__"), _literal(tree, "_ON_USE")
    lines = ["# API reference", "",
             "The public names of `pattern_infra` (`from pattern_infra import <name>`), rendered from their "
             "docstrings.", ""]
    for name in sorted(names, key=str.lower):
        path = f"pattern_infra.{on_use[name]}.{name}" if name in on_use else f"pattern_infra.{name}"
        lines += [f"::: {path}", ""]
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    for site_name, source in ROOT_PAGES.items():
        files.append(File.generated(config, site_name, content=_root_page((ROOT / source).read_text())))
    files.append(File.generated(config, "api.md", content=api_page()))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri in ROOT_PAGES:
        return markdown
    return re.sub(r"\]\(\.\./(README|CHANGELOG)\.md", lambda m: f"]({_site_name(m[1])}", markdown)
