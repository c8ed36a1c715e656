"""``common::const_elimination``: coremltools' pass, run only when it has something to fold.

coremltools' pass replaces each output whose value is known (``var.val`` is not None; also the output
of a ``shape`` op) by a ``const``, and removes the op when every output was replaced. In a conversion it
runs about ten times; on the synthetic mix only the run after ``add_fp16_cast`` folds anything (the
casts of constant weights). Each other run still walks every op through coremltools' properties and
recomputes every var's ``nonreplaceable_vars_upstream`` (see :mod:`generic_passes._cleanup_common`).

This pass looks first, read-only: if no op outside ``const`` has an output with a known value, and the
recomputation would change nothing (:func:`~generic_passes._cleanup_common.would_change`), coremltools' pass
would leave the program as it is, and nothing is done. Otherwise coremltools' own pass runs, with the
pipeline's options (``skip_const_by_size``). Same program by construction. Not a pattern: whether to
run at all is a question about the whole program; registered as a plain graph pass
(:func:`pattern_infra.register_graph_pass`) under coremltools' id.
"""

from __future__ import annotations

from coremltools.converters.mil.mil import Operation, Program

from pattern_infra import register_graph_pass

from ._cleanup_common import would_change

__all__ = ["const_elimination", "foldable"]


def foldable(op: Operation, block_outputs: set[int]) -> bool:
    """Whether ``op`` (not a ``const``) has an output whose value is known (what coremltools' pass
    considers folding; it may still decline, e.g. for a var depending on a ``constexpr_*`` op)."""
    if op.op_type == "const":
        return False
    return any(var._sym_val is not None and var.val is not None for var in op.outputs)


def const_elimination(prog: Program) -> None:
    """Runs coremltools' ``const_elimination`` on ``prog`` unless it would change nothing."""
    if not would_change(prog, foldable):
        return
    original = _CONTAINER.replaces
    assert original is not None, "registered under coremltools' id, so it replaces coremltools' pass"
    graph_pass = original()  # coremltools' class (imported through the registry: importing its
    graph_pass.set_options(_CONTAINER.pass_options)  # module by path would shadow the class in its package)
    graph_pass.apply(prog)  # inside this pass's scope already (PassContainer.apply or the sweep)


_CONTAINER = register_graph_pass(
    const_elimination, "const_elimination", "common", options={"skip_const_by_size": None}
)
