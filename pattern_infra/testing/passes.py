"""Apply-and-check helpers shared by every pass test.

One helper runs a pass id both ways on copies of one program (coremltools' own pass with the override
off, ours with it on) so a test can compare the results op for op, count ops and check numerics.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ..registry import PassContainer
from .convert import experimental_passes

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
    result = copy.deepcopy(prog)
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
    """Runs coremltools' pass and ours on separate copies of ``prog``."""
    return PassOutcome(prog, run_pass(pass_id, prog, generic=False), run_pass(pass_id, prog, generic=True))


def assert_same_program(expected: Program, actual: Program) -> None:
    """Fails with both texts when the printed programs differ."""
    a, b = str(expected), str(actual)
    if a != b:
        raise AssertionError(f"programs differ\n--- expected ---\n{a}\n--- actual ---\n{b}")
