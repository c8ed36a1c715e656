"""The helpers of the design document's API (``detect_pattern``, ``pattern_detected``,
``lists_op_equality``), kept importable from :mod:`pattern_infra` for code written against it. They
run the one search (:class:`~pattern_infra.matching.matcher.Matcher`); new code uses ``find_matches``.
"""

from __future__ import annotations

from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Program, Var

from ..language.compiler import CompiledPattern, compile_pattern
from ..language.pattern import Pattern
from ..matching.matcher import Matcher

__all__ = ["detect_pattern", "lists_op_equality", "pattern_detected"]


_COMPILED: dict[int, tuple[Any, CompiledPattern, Matcher]] = {}


def _pattern_function(root_var: Var) -> Any:
    for op in root_var.child_ops:
        return op.enclosing_block
    raise ValueError(f"pattern root variable {root_var.name} has no consumer")


def detect_pattern(
    program_op: Operation, ops_arrangement_root_var: Var, block: Block
) -> tuple[bool, Pattern | None]:
    """Design-document entry point: is the pattern there, with ``program_op`` as its first op?

    Args:
        program_op: A program op, tried as the pattern's first op (the first consumer of its root).
        ops_arrangement_root_var: The root variable of the pattern program.
        block: The block to search.

    Returns:
        ``(True, pattern)`` on a match, else ``(False, None)``.
    """
    matcher = _function_matcher(_pattern_function(ops_arrangement_root_var))
    found = matcher.match_at(program_op, block, 0)
    return (True, found) if isinstance(found, Pattern) else (False, None)


def _function_matcher(function: Any) -> Matcher:
    cached = _COMPILED.get(id(function))
    if cached is None or cached[0] is not function:
        compiled = compile_pattern(_as_program(function))
        cached = (function, compiled, Matcher(compiled))
        _COMPILED[id(function)] = cached
    return cached[2]


def _as_program(function: Any) -> Any:
    program = Program()
    program.functions["main"] = function
    return program


def pattern_detected(
    pattern: Pattern,
    program_op: Operation,
    pattern_op: Operation,
    program_root_var: Var,
    pattern_root_var: Var,
    block: Block,
) -> bool:
    """Design-document helper: does the pattern match with ``program_op`` standing for ``pattern_op``?

    On success ``pattern`` becomes the match: its ops (``pattern.<name>``), root variable, block, final op.

    Args:
        pattern: The Pattern to fill.
        program_op: Program op placed at ``pattern_op``.
        pattern_op: An op of the pattern program.
        program_root_var: Program variable standing for the pattern's root.
        pattern_root_var: The pattern program's root variable.
        block: The block to search.

    Returns:
        Whether the whole pattern matched.
    """
    function = pattern_op.enclosing_block
    matcher = _function_matcher(function)
    anchor = matcher.compiled.by_name[pattern_op.name]
    found = matcher.match_at(program_op, block, anchor, accept=lambda p: p.root_var is program_root_var)
    if not isinstance(found, Pattern):
        return False
    vars(pattern).update(vars(found))
    return True


def lists_op_equality(oplist1: list[Operation], oplist2: list[Operation]) -> bool:
    """Design-document helper: same length and the same op types in the same order."""
    return len(oplist1) == len(oplist2) and all(a.op_type == b.op_type for a, b in zip(oplist1, oplist2))
