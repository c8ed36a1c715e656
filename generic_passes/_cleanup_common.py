"""What the replacements of coremltools' cleanup passes share: when running coremltools' pass would
change nothing.

coremltools' cleanup passes (``const_elimination``, ``dead_code_elimination``) run about ten times each
in a conversion, and most runs find nothing to do; each run still walks the whole program through
coremltools' op and var properties and, leaving its ``with block:``, recomputes every var's
``nonreplaceable_vars_upstream`` (the set of ``constexpr_*`` vars it depends on, which decides what
``const_elimination`` may fold). The replacements first look, read-only and in one cheap walk, whether
coremltools' pass would change anything; only then do they run coremltools' pass itself.

The recomputation changes nothing when no op of the program is a ``constexpr_*`` op and every var's
set is already empty: it would set every set to the empty set again. :func:`settled` checks exactly
that; where it fails (a program with compressed weights), the replacement runs coremltools' pass.
"""

from __future__ import annotations

from collections.abc import Iterator

from coremltools.converters.mil.mil import Operation, Program

from pattern_infra.blocks import iter_blocks

__all__ = ["all_ops", "settled"]


def all_ops(prog: Program) -> Iterator[Operation]:
    """Every op of every block, nested blocks included."""
    for block in iter_blocks(prog):
        yield from block.operations


def settled(prog: Program) -> bool:
    """Whether recomputing ``nonreplaceable_vars_upstream`` would leave every var as it is: no
    ``constexpr_*`` op, and no var depending on one."""
    for op in all_ops(prog):
        if op.op_type.startswith("constexpr_"):
            return False
        for var in op.outputs:
            if var.nonreplaceable_vars_upstream:
                return False
    return True
