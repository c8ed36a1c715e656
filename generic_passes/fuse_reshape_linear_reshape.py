"""``generic::fuse_reshape_linear_reshape``: drop the reshapes around ``linear`` and unary activations.

Code written for 2-D matrix products (GPT-2's ``Conv1D``: ``x.view(-1, D)``, ``torch.addmm``,
``.view(*lead, N)``) reaches the end of coremltools 9.0's pipeline as a ``linear`` between two reshapes,
four times per GPT-2 block. MIL's ``linear`` maps each row (last axis) of ``x`` on its own,
``y[..., :] = W @ x[..., :] + b``, for ``x`` of rank 1 to 3, so the reshapes only regroup rows that
``linear`` would have mapped one by one anyway.

Math. A ``reshape`` reads and writes elements in row-major order. If it keeps the last dimension
``D`` it moves whole rows, in order: ``reshape(x, [*M, D])`` has the rows of ``x`` (of shape
``[*L, D]``) in the same order, only grouped by other leading dimensions (``prod(M) == prod(L)``).
``linear`` maps rows to rows, so ``linear(reshape(x, [*M, D]))`` holds the rows of ``linear(x)`` grouped
by ``M``, and reshaping that to ``[*L, N]`` gives back exactly ``linear(x)``. The same holds for any
elementwise unary op ``f``: ``reshape(f(reshape(x, S)), shape(x)) == f(x)`` for every shape ``S``,
because ``f`` maps each element on its own and the two reshapes cancel in row-major order::

    Pattern 1 (linear, higher priority): x of static shape [*L, D], rank 1 to 3

        x[*L, D] --> reshape --> [*M, D] --> linear(W[N, D], b[N]) --> [*M, N] --> reshape --> y[*L, N]

    becomes:

        x[*L, D] --> linear(W, b) --> y[*L, N]

    Pattern 2 (elementwise unary op f between reshapes that undo each other): x of static shape S

        x[S] --> reshape --> [S'] --> f --> [S'] --> reshape --> y[S]

    becomes:

        x[S] --> f --> y[S]

    ``f`` is any MIL op that maps each element on its own (see :data:`UNARY_ELEMENTWISE`), whose other
    inputs are compile-time scalars or strings (``gelu``'s mode, ``leaky_relu``'s alpha, ``clip``'s
    bounds, ``cast``'s dtype, ...); ``prelu`` and ``softplus_parametric`` (per-channel parameters) and
    ``softmax`` (not elementwise) are not in the list.

GPT-2's MLP has both: ``reshape -> linear -> reshape -> gelu -> reshape -> linear -> reshape``.
Pattern 1 runs first over the whole program and removes all four reshapes there, leaving
``linear -> gelu -> linear``; pattern 2 catches an activation whose neighbours are not ``linear``.

Shapes are checked strictly: every shape involved is static (no symbol), the first reshape keeps the
last dimension, the second restores exactly ``x``'s shape (pattern 2) or ``x``'s leading dimensions
followed by ``N`` (pattern 1), and ``x``'s rank is one ``linear`` accepts (1 to 3, as
``coremltools/converters/mil/mil/ops/defs/iOS15/linear.py`` documents). The replacement takes the name
of the output it replaces and sits right before the ``linear`` (pattern 1) or the unary op (pattern 2);
the framework removes the two reshapes and the old op. coremltools has no such pass, so this one runs
as a new pass, right after ``common::fuse_leaky_relu`` while ``ENABLE_EXPERIMENTAL_PASSES=1``: by then
``fuse_matmul_weight_bias`` and ``fuse_linear_bias`` have made the ``linear`` ops and the GELU /
leaky-ReLU fusions their activations, and ``merge_consecutive_reshapes`` (later in the pipeline) has
not yet merged the head-merging reshape of attention with the flattening one, which would hide the
``[*L, D] -> [prod(L), D]`` form.
"""

from __future__ import annotations

import math

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var

from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = [
    "UNARY_ELEMENTWISE",
    "reshape_linear_reshape",
    "reshape_unary_reshape",
    "linear_constraints",
    "unary_constraints",
    "transform_linear",
    "transform_unary",
]

UNARY_ELEMENTWISE: tuple[str, ...] = (
    # elementwise_unary.py
    "abs",
    "acos",
    "asin",
    "atan",
    "atanh",
    "cast",
    "ceil",
    "clip",
    "cos",
    "cosh",
    "erf",
    "exp",
    "exp2",
    "floor",
    "inverse",
    "log",
    "logical_not",
    "round",
    "rsqrt",
    "sign",
    "sin",
    "sinh",
    "sqrt",
    "square",
    "tan",
    "tanh",
    "threshold",
    # activation.py
    "clamped_relu",
    "elu",
    "gelu",
    "leaky_relu",
    "linear_activation",
    "relu",
    "relu6",
    "scaled_tanh",
    "sigmoid",
    "sigmoid_hard",
    "silu",
    "softplus",
    "softsign",
    "thresholded_relu",
)
"""MIL ops that map every element on its own, with at most scalar or string parameters."""

_LINEAR_RANKS = (1, 2, 3)
"""Ranks of ``x`` that MIL's ``linear`` accepts (``1 <= rank <= 3`` in its definition)."""


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 4))])
def reshape_linear_reshape(x):
    # Shapes here only make the pattern build; the constraints decide on the program's shapes.
    flat = mb.reshape(x=x, shape=[6, 4], name="flatten")
    lin = mb.linear(x=flat, weight=np.zeros((5, 4), np.float32), bias=np.zeros(5, np.float32), name="linear")
    return mb.reshape(x=lin, shape=[2, 3, 5], name="restore")


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 4))])
def reshape_unary_reshape(x):
    flat = mb.reshape(x=x, shape=[6, 4], name="flatten")
    act = mb.relu(x=flat, name="unary")  # any op of UNARY_ELEMENTWISE (alternatives)
    return mb.reshape(x=act, shape=[2, 3, 4], name="restore")


def _static_shape(var: Var) -> tuple[int, ...] | None:
    if not predicates.shape_known(var):
        return None
    return tuple(int(d) for d in var.shape)


def linear_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """``x`` is ``[*L, D]`` of rank 1-3, the first reshape keeps ``D``, the second gives ``[*L, N]``.

    Returns:
        True, or ``(False, reason)``.
    """
    x = _static_shape(pattern.root_var)
    flat = _static_shape(pattern.flatten.outputs[0])
    lin = _static_shape(pattern.linear.outputs[0])
    out = _static_shape(pattern.restore.outputs[0])
    if x is None or flat is None or lin is None or out is None:
        return False, "a shape is symbolic"
    if len(x) not in _LINEAR_RANKS or not flat or not lin:
        return False, f"x of rank {len(x)}, not 1 to 3"
    if flat[-1] != x[-1] or math.prod(flat) != math.prod(x):
        return False, f"the first reshape {flat} does not keep x's last dimension {x[-1]}"
    if out != x[:-1] + (lin[-1],):
        return False, f"the second reshape gives {out}, not {x[:-1] + (lin[-1],)}"
    return True


def unary_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Static shapes, the reshapes undo each other, every other input of the op a constant scalar/string.

    Returns:
        True, or ``(False, reason)``.
    """
    x = _static_shape(pattern.root_var)
    if x is None or _static_shape(pattern.restore.outputs[0]) != x:
        return False, "the reshapes do not undo each other (or a shape is symbolic)"
    for slot, var in pattern.unary.inputs.items():
        if slot == "x":
            continue
        if not predicates.is_constant(var) or predicates.is_constexpr(var):
            return False, f"the op's {slot} is not a constant"
        if not isinstance(var.val, str) and np.asarray(var.val).size != 1:
            return False, f"the op's {slot} is not a scalar"
    return True


def transform_linear(pattern: Pattern) -> None:
    """``linear(x, W, b)`` named like the second reshape's output, inserted before the old ``linear``."""
    op = pattern.linear
    fused = mb.linear(
        x=pattern.root_var,
        weight=op.weight,
        bias=op.bias,
        name=pattern.restore.outputs[0].name,
        before_op=op,
    )
    pattern.replace_output(fused)


def transform_unary(pattern: Pattern) -> None:
    """The same unary op with the same parameters, on ``x``, named like the second reshape's output."""
    op = pattern.unary
    params = {slot: var for slot, var in op.inputs.items() if slot != "x"}
    fused = getattr(mb, op.op_type)(
        x=pattern.root_var,
        name=pattern.restore.outputs[0].name,
        before_op=op,
        **params,
    )
    pattern.replace_output(fused)


register_generic_pass(
    ops_arrangement=reshape_linear_reshape,
    var_constraints=linear_constraints,
    transform_pattern=transform_linear,
    pass_name="fuse_reshape_linear_reshape",
    namespace="generic",
    priority=1,
    name="reshape_linear_reshape",
    run_after="common::fuse_leaky_relu",
)
register_generic_pass(
    ops_arrangement=reshape_unary_reshape,
    var_constraints=unary_constraints,
    transform_pattern=transform_unary,
    pass_name="fuse_reshape_linear_reshape",
    namespace="generic",
    alternatives={"unary": UNARY_ELEMENTWISE},
    name="reshape_unary_reshape",
    run_after="common::fuse_leaky_relu",
)
