"""The package's module structure (docs/ARCHITECTURE.md): the core in four packages whose imports flow
one way, language -> matching -> rewriting -> passes -> the tools beside them; no import cycle (imports
inside functions and under ``TYPE_CHECKING`` counted); no module reaching into another's private names;
no core module over 450 lines, no other over 500, and the core within its line budget (formatted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pattern_infra"

LONG_MODULES = {"verification/evaluator.py", "testing/models.py", "testing/hf_models.py"}
"""Catalogues allowed to be long: the reference evaluator's op table (one entry per MIL op), the
hand-written model zoo (one small PyTorch module per model family, for tests and examples) and the
transformers zoo (one tiny config per model family)."""


def _modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }


LAYERS = ("language", "matching", "rewriting", "passes")
"""The core's packages, in the order imports may flow (each may import those before it)."""


def _layer(module: str) -> int:
    """The module's place in :data:`LAYERS`; every other module of the package is a tool, after them."""
    part = module.split(".")[1] if "." in module else ""
    return LAYERS.index(part) if part in LAYERS else len(LAYERS)


def _runtime_imports(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names, line) of every import of the module (module level, inside a function or
    under ``TYPE_CHECKING``), relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            names = [alias.name for alias in node.names]
            if not node.module and node.level:  # from . import x: each x is a module
                found += [(f"{target}.{name}", [], node.lineno) for name in names]
            else:
                found.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
    return found


def test_no_module_of_the_package_imports_another_into_a_cycle():
    modules = _modules()
    graph = {
        name: {
            target for target, _, _ in _runtime_imports(path, name) if target in modules and target != name
        }
        for name, path in modules.items()
    }
    graph["pattern_infra"] = (
        set()
    )  # the package's __init__ imports every module by design; none imports it back
    for name in graph:
        graph[name].discard("pattern_infra")
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_core_imports_flow_one_way():
    """language -> matching -> rewriting -> passes -> tools: no module imports one of a later stage."""
    modules = _modules()
    backward = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for module, path in modules.items()
        for target, _, line in _runtime_imports(path, module)
        if target in modules and target != "pattern_infra" and _layer(target) > _layer(module)
    ]
    assert backward == []


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} from {target}"
        for module, path in modules.items()
        for target, names, line in _runtime_imports(path, module)
        if target in modules and target != module
        for name in names
        if name.startswith("_")
    ]
    assert offenders == []


def test_no_module_is_over_500_lines_and_no_core_module_over_450():
    long = {
        str(rel): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines()))
        > (450 if (rel := path.relative_to(PACKAGE)).parts[0] in LAYERS else 500)
        and str(rel) not in LONG_MODULES
    }
    assert long == {}


CORE_BUDGET = 4400
"""The core's lines as ``ruff format`` shapes them (issue #36): at most 4,400. The core is 4,397 (from
4,758, by one restructuring pass over every core package and by docstrings that no longer repeat the
docs); never raise it."""


def test_the_core_stays_within_its_line_budget():
    """Every line of the four core packages counted (docstrings, comments and blank lines included), as
    ``ruff format`` shapes them: the formatter decides a line's shape, so the budget is on formatted code."""
    lines = {
        str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
        for layer in LAYERS
        for path in (PACKAGE / layer).glob("*.py")
    }
    assert sum(lines.values()) <= CORE_BUDGET, sorted(lines.items(), key=lambda item: -item[1])


def test_no_module_generates_or_executes_code():
    """One search engine, written as Python: nothing in the package calls ``exec``, ``eval`` or the
    built-in ``compile``."""
    calls = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} calls {node.func.id}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in {"exec", "eval", "compile"}
    ]
    assert calls == []


def test_no_public_name_shadows_a_module_and_every_public_name_imports():
    """A package's public name (in its ``__all__``) never has the name of one of its modules: the package of
    the registry and the container is ``pattern_infra/passes/``, so ``import pattern_infra.passes.container``
    works, while ``pattern_infra.pipeline`` is the function. Every name of ``pattern_infra.__all__``
    imports."""
    import importlib

    import pattern_infra

    shadowed = []
    for init in PACKAGE.rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        for name in getattr(importlib.import_module(package), "__all__", []):
            if (init.parent / f"{name}.py").exists() or (init.parent / name / "__init__.py").exists():
                shadowed.append(f"{package}.{name}")
    assert shadowed == []
    import pattern_infra.passes.container as c

    assert c.PassContainer is pattern_infra.PassContainer
    assert [name for name in pattern_infra.__all__ if getattr(pattern_infra, name, None) is None] == []
    assert pattern_infra.pipeline().pipeline_name == "pattern_infra"
