"""Apply-and-check helpers shared by every pass test.

One helper runs a pass id both ways on copies of one program (coremltools' own pass with the override
off, ours with it on) so a test can compare the results op for op, count ops and check numerics.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ..registry import PassContainer
from ..verify import clone_program
from .convert import experimental_passes, iter_ops

__all__ = [
    "PassOutcome",
    "override",
    "run_pass",
    "run_both",
    "op_types",
    "assert_same_program",
]


override = experimental_passes
"""Sets ``ENABLE_EXPERIMENTAL_PASSES`` for the duration (alias of :func:`.convert.experimental_passes`)."""


def op_types(prog: Program, include_const: bool = False) -> list[str]:
    """Op types of the main function's block, in program order (consts left out unless asked)."""
    ops = prog.functions["main"].operations
    return [op.op_type for op in ops if include_const or op.op_type != "const"]


def run_pass(pass_id: str, prog: Program, *, generic: bool = True) -> Program:
    """Applies ``pass_id`` to a deep copy of ``prog`` and returns the copy.

    Args:
        pass_id: e.g. ``"common::fuse_gelu_exact"``.
        prog: Left untouched.
        generic: Run our generic pass (override on) or coremltools' own (override off).
    """
    result = clone_program(prog)
    graph_pass = PASS_REGISTRY[pass_id]
    if generic and not isinstance(graph_pass, PassContainer):
        raise AssertionError(f"{pass_id} is not a generic pass; import generic_passes first")
    with override(generic):
        graph_pass.set_options(None)
        graph_pass(result)
    result.validate()
    return result


@dataclass(frozen=True)
class PassOutcome:
    """A program before a pass, after coremltools' pass, and after ours."""

    before: Program
    """The input program (untouched)."""
    coremltools: Program
    """After coremltools' own pass."""
    ours: Program
    """After the generic pass."""

    def counts(self) -> tuple[Counter, Counter, Counter]:
        """Op-type counts before, after coremltools' pass, after ours."""
        return Counter(op_types(self.before)), Counter(op_types(self.coremltools)), Counter(op_types(self.ours))

    def same(self) -> bool:
        """Whether both passes produced the same program text (ops, order, names, constants)."""
        return str(self.coremltools) == str(self.ours)


def run_both(pass_id: str, prog: Program) -> PassOutcome:
    """Runs coremltools' pass and ours on separate copies of ``prog``.

    coremltools' builder names unnamed ops and constants from global counters; both runs start from the
    same counters, so identical rewrites get identical names.
    """
    saved = dict(mb.name_count)
    reference = run_pass(pass_id, prog, generic=False)
    mb.name_count.clear()
    mb.name_count.update(saved)
    return PassOutcome(prog, reference, run_pass(pass_id, prog, generic=True))


AXIS_SLOTS = frozenset({"perm", "axes", "axis"})
"""Integer constants naming axes; ``-1`` and ``rank - 1`` mean the same axis, so they compare modulo
the rank of the op's ``x`` (coremltools' passes rewrite some of them to negative axes in place)."""


def _normalized(op, slot: str, value: np.ndarray) -> np.ndarray:
    x = op.inputs.get("x")
    if slot in AXIS_SLOTS and value.dtype.kind == "i" and x is not None and x.shape is not None:
        return np.mod(value, max(len(x.shape), 1))
    return value


def _const_inputs(prog: Program) -> list[tuple[str, str, str, np.ndarray]]:
    return [
        (op.name, slot, var.name, _normalized(op, slot, np.asarray(var.val)))
        for op in iter_ops(prog)
        if op.op_type != "const"
        for slot, value in op.inputs.items()
        for var in (value if isinstance(value, (list, tuple)) else (value,))
        if var.op is not None and var.op.op_type == "const"
    ]


def assert_same_program(expected: Program, actual: Program) -> None:
    """Fails unless both programs print the same and every constant an op reads has the same value.

    The printed form shows large constants by name only, so values and dtypes are compared too (axis
    constants modulo rank, see :data:`AXIS_SLOTS`).
    """
    a, b = str(expected), str(actual)
    if a != b:
        raise AssertionError(f"programs differ\n--- expected ---\n{a}\n--- actual ---\n{b}")
    for (op, slot, name, x), (_, _, _, y) in zip(_const_inputs(expected), _const_inputs(actual), strict=True):
        if x.dtype != y.dtype or not np.array_equal(x, y):
            raise AssertionError(f"constant {op}.{slot} ({name}) differs: {x!r} vs {y!r}")
