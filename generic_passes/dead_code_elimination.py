"""``common::dead_code_elimination``: coremltools' pass, run only when some op may be dead.

coremltools' pass removes every op none of whose outputs is used: not a block output, not read by an
op that stays (nor inside the sub-blocks of one), not the output of a ``coreml_update_state``. It runs
about ten times in a conversion, and each run walks the whole program and recomputes every var's
``nonreplaceable_vars_upstream`` (see :mod:`generic_passes._cleanup_common`), also when nothing is dead.

If some op is dead, one of them has outputs read by no op at all (the last dead op of a chain of dead
ops). So when every op has an output that some op reads or that is an output of its block, no op is
dead, and with :func:`~generic_passes._cleanup_common.would_change` coremltools' pass would leave the program
as it is: nothing is done. Otherwise (or for ops with no outputs, or a ``coreml_update_state``)
coremltools' own pass runs. Same program by construction. Not a pattern: deadness is a property of
the whole program; registered as a plain graph pass (:func:`pattern_infra.register_graph_pass`) under
coremltools' id.
"""

from __future__ import annotations

from coremltools.converters.mil.mil import Operation, Program

from pattern_infra import register_graph_pass

from ._cleanup_common import would_change

__all__ = ["dead_code_elimination", "may_be_dead"]


def may_be_dead(op: Operation, block_outputs: set[int]) -> bool:
    """Whether ``op`` has no output read by an op or returned by its block (or no outputs at all), or
    updates a state (whose outputs coremltools' pass keeps by their own rule)."""
    if op.op_type == "coreml_update_state" or not op.outputs:
        return True
    return not any(var.child_ops or id(var) in block_outputs for var in op.outputs)


def dead_code_elimination(prog: Program) -> None:
    """Runs coremltools' ``dead_code_elimination`` on ``prog`` unless no op can be dead."""
    if not would_change(prog, may_be_dead):
        return
    original = _CONTAINER.replaces
    assert original is not None, "registered under coremltools' id, so it replaces coremltools' pass"
    original().apply(prog)  # coremltools' class; inside this pass's scope already


_CONTAINER = register_graph_pass(dead_code_elimination, "dead_code_elimination", "common")
