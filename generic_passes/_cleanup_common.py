"""What the replacements of coremltools' cleanup passes share: when running coremltools' pass would
change nothing.

coremltools' cleanup passes (``const_elimination``, ``dead_code_elimination``) run about ten times each
in a conversion, and most runs find nothing to do; each run still walks the whole program through
coremltools' op and var properties and, leaving its ``with block:``, recomputes every var's
``nonreplaceable_vars_upstream`` (the set of ``constexpr_*`` vars it depends on, which decides what
``const_elimination`` may fold). The replacements first look, read-only and in one cheap walk, whether
coremltools' pass would change anything; only then do they run coremltools' pass itself.

The recomputation changes nothing when no op of the program is a ``constexpr_*`` op and every var's
set is already empty: it would set every set to the empty set again. :func:`would_change` checks exactly
that; where it fails (a program with compressed weights), the replacement runs coremltools' pass.
"""

from __future__ import annotations

from collections.abc import Callable

from coremltools.converters.mil.mil import Operation, Program

from pattern_infra.rewriting.blocks import walk_blocks

__all__ = ["would_change"]


def would_change(prog: Program, changes: Callable[[Operation, set[int]], bool]) -> bool:
    """Whether coremltools' cleanup pass could change ``prog``, in one read-only walk: ``changes(op,
    ids of its block's outputs)`` says whether the pass would change ``op``; and leaving each block would
    change its vars' ``nonreplaceable_vars_upstream`` unless no op is a ``constexpr_*`` op and no var
    depends on one (what :mod:`this module <generic_passes._cleanup_common>` explains)."""
    for block, ops in walk_blocks(prog):
        outputs = {id(var) for var in block.outputs}
        for op in ops:
            if op.op_type.startswith("constexpr_") or changes(op, outputs):
                return True
            for var in op.outputs:
                if var.nonreplaceable_vars_upstream:
                    return True
    return False
