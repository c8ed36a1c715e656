"""``generic::merge_reshape_transpose_chains``: chains of reshapes and transposes written in the fewest ops.

Converted attention code moves its tensors through long runs of ``reshape``, ``expand_dims``,
``squeeze`` and ``transpose`` (torchvision's ``nn.MultiheadAttention``: ``view``, ``unsqueeze``,
``transpose``, ``squeeze``, ``view``, ``transpose``, ``view`` per projection). None computes anything;
coremltools merges only ``reshape`` after ``reshape`` (``merge_consecutive_reshapes``, which does not
know that ``expand_dims`` and ``squeeze`` are reshapes too, nor that a ``transpose`` moving size-1 axes
is one) and ``transpose`` after ``transpose``.

Math: a chain of these ops is a permutation of *factors*, the input's axes cut into pieces
(:mod:`generic_passes._layout`); any such permutation is at most ``reshape -> transpose -> reshape``,
and often less. The sizes are proven (``generic_passes._shape_proof``), never assumed.

Pattern 1 (four, three or two ops in a row, each any of reshape / expand_dims / squeeze / transpose /
identity; three patterns, longest first)::

    x[17, 1, 192] --> reshape --> [17, 1, 3, 64] --> expand_dims(0) --> [1, 17, 1, 3, 64]
                  --> transpose([3, 1, 2, 0, 4]) --> [3, 17, 1, 1, 64] --> squeeze(-2) --> y[3, 17, 1, 64]

    becomes (the plan with the fewest ops):

        x[17, 1, 192] --> reshape --> [17, 3, 1, 64] --> transpose([1, 0, 2, 3]) --> y[3, 17, 1, 64]

    and, among others: reshape -> reshape into one reshape; expand_dims -> squeeze undoing it into an
    identity; a transpose moving only size-1 axes, then a reshape, into one reshape.

Pattern 2 (a movement op on each side of a ``linear``): ``linear`` maps each row of the last axis on its
own, so an op that keeps the last axis whole commutes with it; moved to the other side, it merges with
the op there::

    x[1, 17, 64] --> transpose([1, 0, 2]) --> linear(W[192, 64]) --> [17, 1, 192] --> reshape --> y

    becomes:

        x[1, 17, 64] --> linear(W) --> [1, 17, 192] --> reshape --> y

    x[17, 1, 4, 16] --> reshape --> [17, 64] --> linear(W[64, 64]) --> [17, 64] --> reshape --> y[17, 1, 64]

    becomes:

        x[17, 1, 4, 16] --> reshape --> [17, 1, 64] --> linear(W) --> y[17, 1, 64]

Each rewrite leaves fewer ops than it matched (so the pass ends); the last new op takes the name of the
output it replaces. Refused: a size not proven, a regrouping across two input axes (not a permutation of
factors), a plan needing a tensor of rank over 5, a reshape with two symbolic sizes, a ``linear`` over a
tensor of rank other than 1 to 3 (MIL's ``linear``), a weight not of rank 2.

Runs with the override on right after ``generic::hoist_reshape_above_slices``, so the chains that pass
lifts above a head split merge with the ones before it.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation

from pattern_infra import Pattern, register_generic_pass

from ._layout import MOVEMENT_OPS, Layout, Step, emit, emittable, steps_of
from ._shape_proof import ShapeFacts

__all__ = ["MOVEMENT_CHAINS", "chain_constraints", "linear_constraints", "movement_linear"]

_LINEAR_RANKS = (1, 2, 3)


_CHAIN_NAMES = ("first", "second", "third", "fourth")


def _chain_of(length: int):
    """A pattern of ``length`` movement ops in a row (``identity`` stands for any, by alternatives)."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def movement_chain(x):
        for name in _CHAIN_NAMES[:length]:
            x = mb.identity(x=x, name=name)
        return x

    return movement_chain


MOVEMENT_CHAINS = [_chain_of(n) for n in (4, 3, 2)]
"""Chains of four, three and two ops, longest first. Three patterns, not ``optional`` ops: a choice
takes its first alternative that matches, so a chain of two at the head of a longer one would never be
offered on its own when the longer one is refused."""


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
def movement_linear(x):
    moved = mb.identity(x=x, name="before")
    lin = mb.linear(x=moved, weight=np.zeros((4, 3), np.float32), bias=np.zeros(4, np.float32), name="linear")
    return mb.identity(x=lin, name="after")


def _follow(layout: Layout, ops: list[Operation], facts: ShapeFacts) -> str | None:
    for op in ops:
        step = steps_of(op, facts)
        if step is None:
            return f"{op.name}'s shape is unknown"
        reason = layout.apply(step)
        if reason is not None:
            return reason
    return None


def chain_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """The chain's plan has fewer ops than the chain; kept for the transform as ``pattern.plan``."""
    ops = pattern.op_list()
    facts = ShapeFacts.of(pattern.block)
    dims = facts.dims(ops[0].x)
    if dims is None:
        return False, "the input's shape is unknown"
    layout = Layout(facts, dims)
    reason = _follow(layout, ops, facts)
    if reason is not None:
        return False, reason
    plan = layout.plan()
    if isinstance(plan, str):
        return False, plan
    if len(plan) >= len(ops):
        return False, f"{len(ops)} ops need {len(plan)}: nothing to collapse"
    if not emittable(plan):
        return False, "a reshape of the plan has two symbolic sizes"
    pattern.add_attribute("plan", plan)
    return True


def transform_chain(pattern: Pattern) -> None:
    """The plan on the chain's input, its last op named like the chain's output."""
    ops = pattern.op_list()
    out = ops[-1].outputs[0]
    pattern.replace_output(emit(pattern.plan, ops[0].x, name=out.name, before_op=ops[-1]))


def _with_last(step: Step, size) -> Step:
    """The step on a tensor whose last axis (kept whole by the step) has another size."""
    kind, value = step
    return step if kind == "transpose" else (kind, (*value[:-1], size))


def _linear_options(pattern: Pattern) -> list[tuple[str, list[Step]]] | str:
    before, lin, after = pattern.before, pattern.linear, pattern.after
    facts = ShapeFacts.of(pattern.block)
    if lin.weight.rank != 2 or lin.weight.shape is None:
        return "the weight is not of rank 2"
    n_out, d_in = (facts.dim(lin.weight, 0), facts.dim(lin.weight, 1))
    x_dims, lin_dims = facts.dims(before.x), facts.dims(lin.outputs[0])
    step_before, step_after = steps_of(before, facts), steps_of(after, facts)
    if x_dims is None or lin_dims is None or step_before is None or step_after is None:
        return "a shape is unknown"
    planned: list[tuple[str, list[Step] | str]] = []
    first = Layout(facts, x_dims)
    if first.apply(step_before) is None and first.keeps_last_axis() and before.x.rank in _LINEAR_RANKS:
        moved = Layout(facts, (*x_dims[:-1], n_out))
        if moved.apply(_with_last(step_before, n_out)) is None and moved.apply(step_after) is None:
            planned.append(("down", moved.plan()))
    last = Layout(facts, lin_dims)
    if last.apply(step_after) is None and last.keeps_last_axis() and after.outputs[0].rank in _LINEAR_RANKS:
        moved = Layout(facts, x_dims)
        if moved.apply(step_before) is None and moved.apply(_with_last(step_after, d_in)) is None:
            planned.append(("up", moved.plan()))
    options = [(side, plan) for side, plan in planned if not isinstance(plan, str) and emittable(plan)]
    if not options:
        return "neither op keeps the last axis whole, or the two do not merge"
    return options


def linear_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """One side's op moved across the ``linear`` merges with the other's into at most one op."""
    options = _linear_options(pattern)
    if isinstance(options, str):
        return False, options
    side, plan = min(options, key=lambda option: len(option[1]))
    if len(plan) >= 2:
        return False, f"moved across the linear, the two ops need {len(plan)}"
    pattern.add_attribute("side", side)
    pattern.add_attribute("plan", plan)
    return True


def transform_linear(pattern: Pattern) -> None:
    """``linear`` then the merged op ("down"), or the merged op then ``linear`` ("up")."""
    lin, x = pattern.linear, pattern.before.x
    name = pattern.after.outputs[0].name
    if pattern.side == "down":
        named = {} if pattern.plan else {"name": name}
        fused = mb.linear(x=x, weight=lin.weight, bias=lin.bias, before_op=lin, **named)
        pattern.replace_output(emit(pattern.plan, fused, name=name, before_op=lin) if pattern.plan else fused)
        return
    moved = x if not pattern.plan else emit(pattern.plan, x, name=f"{name}_rows", before_op=lin)
    pattern.replace_output(mb.linear(x=moved, weight=lin.weight, bias=lin.bias, name=name, before_op=lin))


_MOVEMENT = list(MOVEMENT_OPS)

for _chain in MOVEMENT_CHAINS:
    register_generic_pass(
        ops_arrangement=_chain,
        var_constraints=chain_constraints,
        transform_pattern=transform_chain,
        pass_name="merge_reshape_transpose_chains",
        namespace="generic",
        alternatives={
            op.name: _MOVEMENT for op in _chain.functions["main"].operations if op.op_type == "identity"
        },
        priority=1,
        name=f"movement_chain_{len(_chain.functions['main'].find_ops(op_type='identity'))}",
        run_after="generic::hoist_reshape_above_slices",
    )
register_generic_pass(
    ops_arrangement=movement_linear,
    var_constraints=linear_constraints,
    transform_pattern=transform_linear,
    pass_name="merge_reshape_transpose_chains",
    namespace="generic",
    alternatives={"before": _MOVEMENT, "after": _MOVEMENT},
    name="movement_linear",
    run_after="generic::hoist_reshape_above_slices",
)
