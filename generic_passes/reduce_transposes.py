"""``common::reduce_transposes``: coremltools' transpose propagation, without its two whole-block wastes.

Not a pattern: the pass propagates transposes through the whole block and cancels them in pairs (a
graph-wide analysis, which coremltools' ``_TransposeOptimization`` does). This module keeps that analysis
and that rewrite as they are (it drives coremltools' own ``_TransposeOptimization``) and changes only
its last step, ``apply_transform``, which at LLM size spends most of its time on two things that do not
change the program:

1. It formats the whole block twice for ``logger.debug`` messages, before calling ``logger.debug``, so
   even with debug logging off (a quarter of the pass at 3k ops). Here the block is formatted only if
   debug logging is on.
2. It re-runs type and value inference on every op of the block, after the rewrite, also when it
   cancelled no transpose (60% of the pass at 3k ops on a program with nothing to cancel). When no
   transpose is cancelled, the block ends as it began (the temporary ``identity`` sinks the analysis
   appends to the outputs are removed again), so re-inferring its ops recomputes the types they have;
   here inference runs only when a transpose was cancelled, and then on every op, as coremltools does.

Everything else (which transposes are cancelled, where transposes are materialised, the temporary sinks
and their builder-made names, blocks with sub-blocks left alone) is coremltools' code, so the program is
the same. Registered as a plain graph pass (:func:`pattern_infra.register_graph_pass`) under
coremltools' id: the override and :func:`pattern_infra.pipeline` use it instead of coremltools' pass.
"""

from __future__ import annotations

import logging

from coremltools.converters.mil.mil import Block, Program
from coremltools.converters.mil.mil.passes.defs.optimize_repeat_ops import _TransposeOptimization

from pattern_infra import register_graph_pass

__all__ = ["reduce_transposes"]

logger = logging.getLogger(__name__)


class _TransposeOptimizationNoWaste(_TransposeOptimization):
    """coremltools' transpose optimisation with ``apply_transform`` skipping the two wastes above."""

    def apply_transform(self) -> None:
        """Cancels the transposes the traversal found cancellable (coremltools' steps, in its order)."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Block before optimize transpose transform:\n%s", self.block)
        self._verify_cancellable_transposes()
        cancelled = list(self.transpose_op_to_cancel_ops)
        for transpose_op in cancelled:
            self._remove_transpose_ops(transpose_op)
        self.block.set_outputs([sink_op.x for sink_op in self.output_sink_ops])
        self.block.remove_ops(list(self.output_sink_ops))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Block after optimize transpose transform:\n%s", self.block)
        if cancelled:
            for op in self.block.operations:
                op.type_value_inference(overwrite_output=True)


def reduce_transposes(prog: Program) -> None:
    """Cancels transposes in every function whose block holds no sub-block (as coremltools' pass)."""
    for function in prog.functions.values():
        _reduce_transposes_block(function)


def _reduce_transposes_block(block: Block) -> None:
    if any(op.blocks for op in block.operations):
        return  # coremltools only optimises flat blocks
    with block:
        optimization = _TransposeOptimizationNoWaste(block)
        optimization.block_traversal()
        optimization.apply_transform()


register_graph_pass(reduce_transposes, "reduce_transposes", "common")
