"""Helpers shared by the numbered example scripts (not an example itself).

The scripts run as ``python examples/NN_name.py`` from the repository root; Python then puts
``examples/`` first on ``sys.path``, so a plain ``import _common`` finds this module. Import it before
coremltools: it quiets the warnings coremltools logs at import when its native library is missing.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

logging.getLogger("coremltools").setLevel(logging.ERROR)

import numpy as np  # noqa: E402
from coremltools.converters.mil.mil import Block, Program, Var  # noqa: E402
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY  # noqa: E402

from pattern_infra.verification.evaluator import evaluate  # noqa: E402

__all__ = [
    "banner",
    "value_text",
    "listing",
    "show",
    "op_types",
    "rewrite",
    "check",
    "random_inputs",
    "compare",
]


def banner(title: str) -> None:
    """Prints a section heading."""
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def value_text(value: Any) -> str:
    """A variable as the listings show it: its name, or a constant's value (its shape if large)."""
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(value_text(v) for v in value) + ")"
    if not isinstance(value, Var):
        return repr(value)
    if value.op is None or value.op.op_type != "const" or value.val is None:
        return value.name
    arr = np.asarray(value.val)
    if arr.dtype.kind not in "biuf":
        return repr(arr.item()) if arr.size == 1 else f"const{arr.shape}"
    if arr.ndim == 0:
        return str(arr.item()) if arr.dtype.kind == "b" else f"{arr.item():.7g}"
    if arr.size <= 4:
        items = arr.ravel().tolist()
        return "[" + ", ".join(str(v) if isinstance(v, bool) else f"{v:.4g}" for v in items) + "]"
    return f"const{arr.shape}"


def _block_lines(block: Block, indent: str) -> list[str]:
    lines = []
    for op in block.operations:
        if op.op_type == "const":
            continue
        args = ", ".join(f"{slot}={value_text(v)}" for slot, v in op.inputs.items())
        lines.append(f"{indent}{', '.join(v.name for v in op.outputs)} = {op.op_type}({args})")
        for i, inner in enumerate(op.blocks):
            lines.append(f"{indent}  block {i}:")
            lines.extend(_block_lines(inner, indent + "    "))
    lines.append(f"{indent}return {', '.join(v.name for v in block.outputs)}")
    return lines


def listing(prog: Program) -> str:
    """The main function's inputs and non-const ops, one per line: ``out = op(x=a, y=0.5)``."""
    main = prog.functions["main"]
    inputs = ", ".join(f"{name}{tuple(var.shape)}" for name, var in main.inputs.items())
    return "\n".join([f"  inputs: {inputs}"] + _block_lines(main, "  "))


def show(prog: Program, title: str) -> None:
    """Prints a title and the program's listing."""
    print(f"{title}:\n{listing(prog)}")


def op_types(prog: Program) -> list[str]:
    """Non-const op types of the main block, in program order."""
    return [op.op_type for op in prog.functions["main"].operations if op.op_type != "const"]


def rewrite(graph_pass: str | Callable[[Program], Any], prog: Program) -> Program:
    """Prints ``prog``, runs a pass (id or PassContainer) on a copy, prints the copy and returns it."""
    graph_pass = PASS_REGISTRY[graph_pass] if isinstance(graph_pass, str) else graph_pass
    after = copy.deepcopy(prog)
    graph_pass(after)
    show(prog, "before")
    show(after, f"after {getattr(graph_pass, 'pass_id', graph_pass)}")
    return after


def check(condition: bool, what: str) -> None:
    """Prints ``ok: what``, or stops the script with a non-zero exit status."""
    if not condition:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


def random_inputs(prog: Program, seed: int = 0) -> dict[str, np.ndarray]:
    """One standard-normal array per input of ``prog`` (its shapes must be known)."""
    rng = np.random.default_rng(seed)
    inputs = prog.functions["main"].inputs
    return {name: rng.standard_normal(tuple(var.shape)) for name, var in inputs.items()}


def compare(
    before: Program, after: Program, feed: Mapping[str, np.ndarray] | None = None, *, tol: float = 1e-6
) -> None:
    """Runs both programs in numpy (float64) on the same inputs; checks the outputs agree within ``tol``.

    ``tol`` is both the relative and the absolute tolerance; the default covers programs whose constants
    are float32 values of the same numbers (e.g. 0.044715 written in a pattern and in the op's formula).
    """
    feed = feed if feed is not None else random_inputs(before)
    expected, got = list(evaluate(before, feed).values()), list(evaluate(after, feed).values())
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(expected, got))
    same = all(np.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(expected, got))
    check(len(expected) == len(got) and same, f"same outputs before and after (max |diff| {worst:.1e})")
