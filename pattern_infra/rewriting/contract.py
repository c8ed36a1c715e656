"""The contract of one rewrite (docs/ARCHITECTURE.md, "The rewrite's contract"), checked right after it
on the ops it touched (:func:`broken_contract`); a breach is a mistake of the transform, raised with its
fix. The constants a match reads are read-only while its transform runs (:func:`read_only_constants`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
from coremltools.converters.mil.mil import Block, Function, Operation, Var

from .blocks import BlockIndex, flat_inputs

__all__ = ["USE_THE_NEW_OPS", "broken_contract", "read_only_constants", "returned_names"]

USE_THE_NEW_OPS = (
    "Call pattern.replace_output(new_var) (or replace_outputs) to redirect the match's users to the "
    "replacement, and build only the ops the replacement needs; the framework then removes the matched ops."
)

BEFORE_ITS_USERS = (
    "Insert each new op before its first user: mb.<op>(..., before_op=pattern.<final op>) (an op built "
    "without before_op goes to the end of the block, after the ops that read it), inside the match's block."
)

KEEP_THE_OUTPUTS = (
    "Leave a block's outputs to pattern.replace_output(new_var): it keeps a returned variable's name "
    "(the model's output names); never set the outputs in a transform."
)

Indexes = Callable[[Block], BlockIndex]  # a block's index, for the order of its ops


def returned_names(block: Block) -> tuple[str, ...] | int:
    """What a rewrite must keep of ``block``'s outputs: their names for a function (the model's outputs),
    their number for a nested block (its op's outputs)."""
    if isinstance(block, Function):
        return tuple(var.name for var in block._outputs)
    return len(block._outputs)


def broken_contract(
    created: list[Operation],
    rewired: list[Operation],
    block: Block,
    returned: tuple[str, ...] | int,
    index: Indexes,
    replacements: Sequence[Var] = (),
) -> tuple[str, str] | None:
    """What one rewrite broke of its contract, as (the mistake, its fix), or None; linear in the size of
    the rewrite: only the ops it ``created`` and those it ``rewired`` are looked at."""
    now = returned_names(block)
    if now != returned:
        what = "number of outputs of block" if isinstance(now, int) else "outputs of function"
        return f"changed the {what} {block.name} from {_listed(returned)} to {_listed(now)}", KEEP_THE_OUTPUTS
    live = [op for op in created if op.enclosing_block is not None]
    unused = [
        op
        for op in live
        if not any(var._child_ops or var.consuming_blocks or var in replacements for var in op._output_vars)
    ]
    if unused:
        return f"built [{', '.join(op.name for op in unused)}] but nothing uses them", USE_THE_NEW_OPS
    reads = [(var, user) for op in live for var in op._output_vars for user in var._child_ops]
    reads += [(var, op) for op in live for var in flat_inputs(op)]
    for op in rewired:  # what it reads from a removed op, or from another block (rewrites move no op)
        here = op.enclosing_block
        if here is not None:
            reads += [
                (var, op)
                for var in flat_inputs(op)
                if var._op is not None and var._op not in live and var._op.enclosing_block is not here
            ]
    for var, user in reads:
        problem = _unseen(var, user, index)
        if problem is not None:
            return problem, BEFORE_ITS_USERS
    for var in block._outputs:
        producer = var._op
        if producer is not None and not _encloses(producer.enclosing_block, block):
            return f"made block {block.name} return {var.name}, defined outside it", BEFORE_ITS_USERS
    return None


def _listed(returned: tuple[str, ...] | int) -> str:
    return str(returned) if isinstance(returned, int) else f"[{', '.join(returned)}]"


def _unseen(var: Var, user: Operation, index: Indexes) -> str | None:
    """Why ``user`` cannot read ``var`` where it stands, or None if it can."""
    producer = var._op
    if producer is None:
        return None  # an input of a function or of a block
    home = producer.enclosing_block
    if home is None:
        return f"left {user.name} reading {var.name}, whose op {producer.name} was removed"
    holder = _holder(home, user)
    if holder is None:
        return f"left {user.name} reading {var.name}, defined in block {home.name}, which does not enclose it"
    if holder is producer or not index(home).precedes(producer, holder):
        where = "" if holder is user else f" (it lies inside {holder.name})"
        return f"left {user.name} reading {var.name}, which is computed after it{where}"
    return None


def _holder(home: Block, user: Operation) -> Operation | None:
    """The op of ``home`` that is ``user`` or holds the block ``user`` lies in; None when ``home`` does
    not enclose ``user``."""
    op, block = user, user.enclosing_block
    while block is not home:
        op = block.outer_op if block is not None else None
        if op is None:
            return None
        block = op.enclosing_block
    return op


def _encloses(home: Block | None, block: Block) -> bool:
    """Whether ``home`` is ``block`` or a block around it."""
    outer = block.outer_op
    return block is home or (home is not None and outer is not None and _holder(home, outer) is not None)


def read_only_constants(ops: Iterable[Operation]) -> list[np.ndarray]:
    """Makes the constant tensors ``ops`` read read-only (a transform writing into one raises), returning
    them to make them writable again; only arrays that own their memory (numpy may refuse to make a view
    writable again)."""
    frozen: list[np.ndarray] = []
    for op in ops:
        for operand in op._input_vars.values():  # flat_inputs' walk, without building its list
            for var in operand if isinstance(operand, (list, tuple)) else (operand,):
                producer = getattr(var, "_op", None)
                if producer is not None and type(producer).__name__ == "const" and var._sym_val is not None:
                    value = var._sym_val.val
                    if type(value) is np.ndarray and value.flags.writeable and value.flags.owndata:
                        value.flags.writeable = False
                        frozen.append(value)
    return frozen
