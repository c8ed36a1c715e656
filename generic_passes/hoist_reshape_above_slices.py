"""``generic::hoist_reshape_above_slices``: the same reshape or transpose after every slice of a tensor,
done once on the tensor before the slices.

Attention computes ``q``, ``k`` and ``v`` with one in-projection and takes them apart by index (PyTorch's
``unflatten(-1, (3, E))`` then ``qkv[0]``, ``qkv[1]``, ``qkv[2]``: one ``slice_by_index`` each), then moves
each the same way (the head split: ``view``, ``transpose``, ``view``). Three copies of each op, and the
copies stand between the slices and the chain before them, so no chain pass can merge them.

Math: when ``x``'s axis ``a`` is cut into single indices, ``x[..., i, ...]`` (``a`` squeezed or kept as a
size-1 axis) followed by a movement op ``M`` equals ``M'(x)[i]``, where ``M'`` first brings axis ``a``
to the front and then applies ``M`` to every index at once (a reshape to ``[n, *shape]``, a transpose
with ``0`` prepended to its permutation, :mod:`generic_passes._layout` writing it in the fewest ops).
When every consumer of ``x`` is such a slice followed by the same ``M``::

    x[3, 17, 1, 64] --> slice_by_index(x[0]) --> [17, 1, 64] --> reshape --> [17, 4, 16] --> ...
                    --> slice_by_index(x[1]) --> [17, 1, 64] --> reshape --> [17, 4, 16] --> ...
                    --> slice_by_index(x[2]) --> [17, 1, 64] --> reshape --> [17, 4, 16] --> ...

    becomes:

    x[3, 17, 1, 64] --> reshape --> [3, 17, 4, 16] --> slice_by_index([0]) --> [17, 4, 16] --> ...
                                                   --> slice_by_index([1]) --> [17, 4, 16] --> ...
                                                   --> slice_by_index([2]) --> [17, 4, 16] --> ...

Each match is one slice and its op; the first rewrite builds ``M'`` right after ``x`` is computed, the
others reuse it, so the program has no more ops after the first rewrite and one fewer after each other.
The new slice takes index ``i`` on axis 0 (squeezed) and the name of ``M``'s output. Refused: a slice
taking more than one index, a stride, or a range along another axis; ``M'`` needing more than one op
(axis ``a`` not outermost and ``M`` a reshape); a consumer of ``x`` that is not such a slice followed by
the same ``M`` (nor ``M'``), or one in another block; fewer than two slices; a slice output used
elsewhere or a block output.

Runs with the override on right after ``generic::fuse_sdpa``; ``generic::merge_reshape_transpose_chains`` then
merges ``M'`` with the chain before it.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, Var

from pattern_infra import Pattern, register_generic_pass

from ._layout import MOVEMENT_OPS, Layout, Step, emittable, steps_of
from ._shape_proof import ShapeFacts

__all__ = ["single_index", "slice_movement"]


@mb.program(input_specs=[mb.TensorSpec(shape=(3, 4))])
def slice_movement(x):
    picked = mb.slice_by_index(x=x, begin=[0, 0], end=[1, 4], name="slice")
    return mb.identity(x=picked, name="move")  # any movement op (alternatives)


def _flags(op: Operation, name: str, rank: int) -> list[bool]:
    var = op.inputs.get(name)
    if var is None:
        return [False] * rank
    return [bool(f) for f in np.asarray(var.val).reshape(-1)]


def single_index(op: Operation) -> tuple[int, int, bool] | None:
    """``(axis, index, squeezed)`` when the slice takes one index on one axis and all of the others."""
    x = op.x
    if x.shape is None or op.begin.val is None or op.end.val is None:
        return None
    rank = x.rank
    if op.stride is not None and (op.stride.val is None or np.any(np.asarray(op.stride.val) != 1)):
        return None
    begin, end = np.asarray(op.begin.val).reshape(-1), np.asarray(op.end.val).reshape(-1)
    begin_mask, end_mask = _flags(op, "begin_mask", rank), _flags(op, "end_mask", rank)
    squeeze = _flags(op, "squeeze_mask", rank)
    picked = []
    for axis in range(rank):
        size = x.shape[axis]
        if not isinstance(size, (int, np.integer)):  # a symbolic axis: only taken whole
            if (begin_mask[axis] or int(begin[axis]) == 0) and end_mask[axis] and not squeeze[axis]:
                continue
            return None
        size = int(size)
        b = 0 if begin_mask[axis] else int(begin[axis]) + (size if int(begin[axis]) < 0 else 0)
        e = size if end_mask[axis] else int(end[axis]) + (size if int(end[axis]) < 0 else 0)
        if not 0 <= b < size:
            return None
        if squeeze[axis]:
            picked.append((axis, b, True))
        elif b == 0 and e >= size:
            continue
        elif e == b + 1:
            picked.append((axis, b, False))
        else:
            return None
    if len(picked) != 1:
        return None
    return picked[0]


def _batched_plan(x: Var, axis: int, move: Operation, facts: ShapeFacts) -> list[Step] | str:
    """``M'``: axis ``axis`` of ``x`` to the front, then ``move`` on every index at once."""
    dims, sliced, out = facts.dims(x), facts.dims(move.x), facts.dims(move.outputs[0])
    step = steps_of(move, facts)
    if dims is None or sliced is None or out is None or step is None:
        return "a shape is unknown"
    layout = Layout(facts, dims)
    rest = [i for i in range(len(dims)) if i != axis]
    steps: list[Step] = [("transpose", (axis, *rest))]
    steps.append(("reshape", (dims[axis], *sliced)))
    kind, value = step
    steps.append(
        ("transpose", (0, *(p + 1 for p in value))) if kind == "transpose" else (kind, (dims[axis], *out))
    )
    for s in steps:
        reason = layout.apply(s)
        if reason is not None:
            return reason
    plan = layout.plan()
    if isinstance(plan, str):
        return plan
    if len(plan) != 1 or not emittable(plan):
        return f"done before the slices, {move.op_type} needs {len(plan)} ops"
    return plan


def _same_op(op: Operation, x: Var, step: Step, facts: ShapeFacts) -> bool:
    """``op`` is ``step`` on ``x``."""
    if op.op_type not in MOVEMENT_OPS or op.x is not x:
        return False
    own = steps_of(op, facts)
    if own is None or (own[0] == "transpose") != (step[0] == "transpose"):
        return False
    return own[1] == step[1] if step[0] == "transpose" else facts.same_dims(own[1], step[1])


def constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Every consumer of ``x`` is a single-index slice on one axis followed by the same op (or ``M'``)."""
    x, facts = pattern.root_var, ShapeFacts.of(pattern.block)
    picked = single_index(pattern.slice)
    if picked is None:
        return False, "the slice does not take one index on one axis"
    axis = picked[0]
    plan = _batched_plan(x, axis, pattern.move, facts)
    if isinstance(plan, str):
        return False, plan
    slices = 0
    block_outputs = set(pattern.block.outputs)
    for user in dict.fromkeys(x.child_ops):
        if user.enclosing_block is not pattern.block:
            return False, f"{user.name} reads x in another block"
        if _same_op(user, x, plan[0], facts):
            continue
        other = single_index(user) if user.op_type == "slice_by_index" else None
        if other is None or other[0] != axis:
            return False, f"{user.name} reads x and is not a slice on axis {axis}"
        out = user.outputs[0]
        if out in block_outputs or len(out.child_ops) != 1:
            return False, f"{user.name}'s output is used elsewhere"
        follower = out.child_ops[0]
        if follower.op_type not in MOVEMENT_OPS or _batched_plan(x, axis, follower, facts) != plan:
            return (
                False,
                f"{user.name} is followed by {follower.name}, not the same op as {pattern.move.name}",
            )
        slices += 1
    if slices < 2 and not any(_same_op(u, x, plan[0], facts) for u in x.child_ops):
        return False, "one slice only: nothing to share"
    pattern.add_attribute("plan", plan)
    pattern.add_attribute("index", picked[1])
    return True


def _after_producer(pattern: Pattern, x: Var) -> Operation:
    """The op right after ``x``'s producer in the block (the block's first op for an input)."""
    ops = pattern.block.operations
    if x.op is not None and x.op.enclosing_block is pattern.block:
        return ops.op_to_node[x.op].next.op
    return ops.start.op


def transform(pattern: Pattern) -> None:
    """``M'`` (found among ``x``'s users, or built after ``x``), then the slice of index ``i`` on axis 0."""
    x, facts = pattern.root_var, ShapeFacts.of(pattern.block)
    (kind, value) = pattern.plan[0]
    moved = next((u.outputs[0] for u in x.child_ops if _same_op(u, x, (kind, value), facts)), None)
    if moved is None:
        at = _after_producer(pattern, x)
        if kind == "transpose":
            moved = mb.transpose(x=x, perm=list(value), before_op=at)
        else:
            moved = mb.reshape(x=x, shape=[int(d) if d.is_Integer else -1 for d in value], before_op=at)
    rank = moved.rank
    out = pattern.move.outputs[0]
    picked = mb.slice_by_index(
        x=moved,
        begin=[pattern.index] + [0] * (rank - 1),
        end=[pattern.index + 1] + [0] * (rank - 1),
        end_mask=[False] + [True] * (rank - 1),
        squeeze_mask=[True] + [False] * (rank - 1),
        name=out.name,
        before_op=pattern.move,
    )
    pattern.replace_output(picked)


register_generic_pass(
    ops_arrangement=slice_movement,
    var_constraints=constraints,
    transform_pattern=transform,
    pass_name="hoist_reshape_above_slices",
    namespace="generic",
    alternatives={"move": list(MOVEMENT_OPS)},
    name="slice_movement",
    run_after="generic::fuse_sdpa",
)
