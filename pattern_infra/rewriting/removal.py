"""Dead-op removal: the matched ops a transform left without users go, without ``Block.remove_ops``'
copies."""

from __future__ import annotations

from coremltools.converters.mil.mil import Block, Operation, Var
from coremltools.converters.mil.mil.var import InternalVar

from ..language.pattern import Pattern
from .blocks import flat_inputs
from .journal import journals_on_this_thread

__all__ = ["remove_dead", "remove_dead_ops", "unlink"]


def remove_dead_ops(match: Pattern) -> list[Operation]:
    """Removes and returns the matched ops still in the block whose outputs are no block output and read
    by no op but dead ones (consumers first: a chain dies in one visit)."""
    return [op for op, _ in remove_dead(match)]


def remove_dead(match: Pattern) -> list[tuple[Operation, list[Var]]]:
    """:func:`remove_dead_ops`, returning each removed op with the variables it read."""
    block = match.block
    dead: set[Operation] = set()
    order: list[Operation] = []
    for op in match._reverse_topological():
        if op.enclosing_block is not block:
            continue
        for var in op._output_vars:
            if var.consuming_blocks or not dead.issuperset(var._child_ops):
                break
        else:
            dead.add(op)
            order.append(op)
    return unlink(block, order) if order else []


def unlink(block: Block, ops: list[Operation]) -> list[tuple[Operation, list[Var]]]:
    """Takes ``ops``, dead ops of ``block``, out of it: ``Block.remove_ops`` without its checks and copies
    (ops with nested blocks or internal inputs go through it). Each open journal records the removal."""
    removal = [(op, flat_inputs(op)) for op in ops]
    for op in ops:
        if op.blocks or any(isinstance(value, InternalVar) for value in op._input_vars.values()):
            block.remove_ops(ops)
            return removal
    ops_list = block.operations
    for journal in journals_on_this_thread():
        journal.unlinked(block, removal)
    for op, inputs in removal:
        ops_list.remove(op)
        op.enclosing_block = None
        for var in inputs:
            var._child_ops.remove(op)
    return removal
