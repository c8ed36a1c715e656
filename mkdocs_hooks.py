"""mkdocs hooks: put README.md, CHANGELOG.md and an API page generated from ``pattern_infra.__all__`` on
the site.

README.md and CHANGELOG.md live at the repository's root, where GitHub shows them; the site serves them as
``index.md`` and ``changelog.md`` with their links rewritten (``docs/X.md`` -> ``X.md``). The API page
lists every name of ``pattern_infra.__all__`` as ``pattern_infra.<name>``, read from the package's
``__init__.py`` without importing it (names imported on first use are documented where ``_ON_USE``
says they live, and a name that is also a submodule's where it is imported from), so the page follows
the package as its modules move.
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


def _shadowed(tree: ast.Module) -> dict[str, str]:
    """Names imported from a submodule that share their name with another submodule (``explain`` from
    ``explain.py``): ``pattern_infra.<name>`` would name the module, so these are documented at their
    source."""
    package = ROOT / "pattern_infra"
    shadowed = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                name = alias.asname or alias.name
                if (package / f"{name}.py").exists() or (package / name).is_dir():
                    shadowed[name] = f"{node.module}.{alias.name}"
    return shadowed


def api_page() -> str:
    """The API reference: one mkdocstrings entry per name of ``pattern_infra.__all__``."""
    tree = ast.parse((ROOT / "pattern_infra" / "__init__.py").read_text())
    on_use = {name: f"{module}.{name}" for name, module in _literal(tree, "_ON_USE").items()}
    names, at_source = _literal(tree, "__all__"), {**on_use, **_shadowed(tree)}
    lines = [
        "# API reference",
        "",
        "The public names of `pattern_infra` (`from pattern_infra import <name>`), rendered from their "
        "docstrings.",
        "",
    ]
    for name in sorted(names, key=str.lower):
        path = f"pattern_infra.{at_source.get(name, name)}"
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
