"""``common::dead_code_elimination``: coremltools' pass, run only when some op may be dead.

coremltools' pass removes every op none of whose outputs is used: not a block output, not read by an
op that stays (nor inside the sub-blocks of one), not the output of a ``coreml_update_state``. It runs
about ten times in a conversion, and each run walks the whole program and recomputes every var's
``nonreplaceable_vars_upstream`` (see :mod:`generic_passes._cleanup_common`), also when nothing is dead.

If some op is dead, one of them has outputs read by no op at all (the last dead op of a chain of dead
ops). So when every op has an output that some op reads or that is an output of its block, no op is
dead, and with :func:`~generic_passes._cleanup_common.settled` coremltools' pass would leave the program
as it is: nothing is done. Otherwise (or for ops with no outputs, or a ``coreml_update_state``)
coremltools' own pass runs. Same program by construction. Not a pattern: deadness is a property of
the whole program; registered as a plain graph pass (:func:`pattern_infra.register_graph_pass`) under
coremltools' id.
"""

from __future__ import annotations

from coremltools.converters.mil.mil import Program

from pattern_infra import register_graph_pass
from pattern_infra.blocks import iter_blocks

from ._cleanup_common import settled

__all__ = ["dead_code_elimination", "may_have_dead_ops"]


def may_have_dead_ops(prog: Program) -> bool:
    """Whether some op has no output read by an op or returned by its block (or no outputs at all), or
    the program updates a state (whose outputs coremltools' pass keeps by their own rule)."""
    for block in iter_blocks(prog):
        outputs = {id(var) for var in block.outputs}
        for op in block.operations:
            if op.op_type == "coreml_update_state" or not op.outputs:
                return True
            if not any(var.child_ops or id(var) in outputs for var in op.outputs):
                return True
    return False


def dead_code_elimination(prog: Program) -> None:
    """Runs coremltools' ``dead_code_elimination`` on ``prog`` unless no op can be dead."""
    if not may_have_dead_ops(prog) and settled(prog):
        return
    _CONTAINER.replaces().apply(prog)  # coremltools' class; inside this pass's scope already


_CONTAINER = register_graph_pass(dead_code_elimination, "dead_code_elimination", "common")
