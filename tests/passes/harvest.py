"""The programs a pass-test module builds, without running its tests (:func:`harvest`): the layer-norm
rewrite test compares the pass with its 112-sub-pass reference on every one of them."""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import numpy as np
import pytest
from coremltools.converters.mil.mil import Program

_PARAMETER_SET = type(pytest.param(None))


def _parameter_rows(test: Any) -> list[dict[str, Any]]:
    """The parameter combinations of a test's stacked ``parametrize`` marks."""
    axes = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize" or len(mark.args) < 2:
            continue
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = []
        for value in mark.args[1]:
            if isinstance(value, _PARAMETER_SET):
                value = value.values[0] if len(names) == 1 else value.values
            rows.append({names[0]: value} if len(names) == 1 else dict(zip(names, value)))
        axes.append(rows)
    if not axes:
        return []
    return [dict(kv for row in combo for kv in row.items()) for combo in itertools.product(*axes)]


def _plain(value: Any) -> bool:
    """Data a builder can take without side effects on shared objects (no program, no module)."""
    if value is None or isinstance(value, (str, int, float, bool, np.generic, np.ndarray)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _is_builder(name: str, f: Any) -> bool:
    """A function of the module that builds a program: annotated so, or public with every parameter
    defaulted. Helpers that take a program (and may run passes on it) are never builders."""
    signature = inspect.signature(f)
    if signature.return_annotation in ("Program", Program):
        return True
    return not name.startswith(("_", "test")) and all(
        p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        for p in signature.parameters.values()
    )


def harvest(module: Any, limit: int = 25) -> list[Program]:
    """Programs a pass-test module builds, without running any of its tests.

    Its builders are called with their defaults and with its tests' parameter combinations (plain data
    only); programs its tests are parametrized with are taken as they are.
    """
    functions = {
        n: f for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == module.__name__
    }
    builders = [f for n, f in functions.items() if not n.startswith("test") and _is_builder(n, f)]
    rows: list[dict[str, Any]] = [{}]
    programs: list[Program] = []
    for name, test in functions.items():
        if name.startswith("test"):
            for row in _parameter_rows(test):
                programs.extend(v for v in row.values() if isinstance(v, Program))
                rows.append(row)
    seen: set[str] = set()
    for builder in builders:
        parameters = inspect.signature(builder).parameters
        required = {
            n
            for n, p in parameters.items()
            if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }
        for row in rows:
            kwargs = {k: v for k, v in row.items() if k in parameters}
            extra = row.get("kwargs")
            if isinstance(extra, dict) and set(extra) <= set(parameters):
                kwargs.update(extra)
            if not required <= set(kwargs) or not _plain(kwargs):
                continue
            key = f"{builder.__name__}{sorted((k, repr(v)) for k, v in kwargs.items())}"
            if key in seen or len(programs) >= limit:
                continue
            seen.add(key)
            try:
                result = builder(**kwargs)
            except Exception:  # noqa: BLE001 - a combination this builder does not take
                continue
            for value in result if isinstance(result, tuple) else (result,):
                if isinstance(value, Program):
                    programs.append(value)
    return programs
