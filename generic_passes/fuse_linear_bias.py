"""``common::fuse_linear_bias``: a constant added to (or subtracted from) a ``linear`` goes into its bias.

Math: ``linear(x, W, b) = x @ W.T + b``, so with a constant ``c`` whose values vary only along the last
axis (``c`` has ``Dout`` elements, laid out as ``(..., 1, Dout)``)::

    linear(x, W, b) + c  =  linear(x, W, b + c)
    c + linear(x, W, b)  =  linear(x, W, b + c)
    linear(x, W, b) - c  =  linear(x, W, b - c)
    c - linear(x, W, b)  =  linear(x, -W, c - b)

One registration covers all four: ``add`` and ``sub`` are alternatives of the same pattern op, and the
matcher tries both operand orders of it. Which side the ``linear`` is on is read from the match (the
identity of the variables), since it changes the math for ``sub``::

    x --> linear(W, b) --> add_or_sub(c) --> y          add_or_sub: add or sub, linear on either side
                                                        W, b, c: compile-time constants

    becomes:

    x --> linear(W', b') --> y                          W' = W (or -W for c - linear), b' as above

As coremltools does, the new ``linear`` is inserted before the old one, takes the name of the output it
replaces, and receives its weight and bias as fresh constants (so their names are ``<name>_weight_0`` and
``<name>_bias_0``, as in coremltools' program).

A compressed ``W`` (``constexpr_*`` ops, e.g. palettized or int8; ``ConstRule("weight")``) stays as it
is: the bias is a plain constant whatever the weight. For ``c - linear`` its negation goes into its
constexpr ops (scale or LUT, or a new ``constexpr_blockwise_shift_scale`` at iOS18), never decompressed;
where that is impossible the match is refused with the reason. coremltools leaves such a ``linear`` alone.

``var_constraints`` keeps coremltools' refusals: ``b`` a compile-time constant, ``c`` with as many
elements as ``b`` and ``Dout`` on its last axis. It adds one coremltools lacks, which protects
correctness: ``c`` may not have more dimensions than the ``linear`` output (``(2, 4) + (1, 1, 4)`` is
``(1, 2, 4)``; coremltools 9.0 fuses it and the program's output loses a dimension). A scalar ``c`` is
taken as ``(1,)`` (coremltools raises ``IndexError`` on it when ``Dout == 1`` and refuses it otherwise, as
does this pass).
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, register_generic_pass

from ._compressed import scale_compressed, scale_refusal

__all__ = ["linear_bias_pattern", "linear_bias_constraints", "transform_linear_bias"]

_D_OUT, _D_IN = 4, 3


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), _D_IN))])
def linear_bias_pattern(x):
    linear = mb.linear(
        x=x,
        weight=np.zeros((_D_OUT, _D_IN), dtype=np.float32),
        bias=np.zeros(_D_OUT, dtype=np.float32),
        name="linear",
    )
    return mb.add(x=linear, y=np.zeros(_D_OUT, dtype=np.float32), name="add_or_sub")


def _bias_shape(bias: np.ndarray) -> tuple[int, ...]:
    return np.shape(bias) or (1,)


def _negates_weight(pattern: Pattern) -> bool:
    """Whether the fusion negates ``W`` (``c - linear``)."""
    add_or_sub = pattern.add_or_sub
    return add_or_sub.op_type == "sub" and add_or_sub.x is not pattern.linear.outputs[0]


def linear_bias_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """``c`` has ``Dout`` values along its last axis and does not broadcast the output to a higher rank;
    a compressed ``W`` that ``c - linear`` negates can take the factor -1."""
    d_out = pattern.linear.bias.val.shape[0]
    bias = pattern.operand("add_or_sub", "y").val
    shape = _bias_shape(bias)
    if not (
        int(np.prod(shape)) == d_out
        and shape[-1] == d_out
        and len(np.shape(bias)) <= pattern.linear.outputs[0].rank
    ):
        return False, f"c of shape {np.shape(bias)} is not {d_out} values along the last axis"
    weight = pattern.linear.weight
    if weight.val is None and _negates_weight(pattern):
        reason = scale_refusal(weight, (1, 1), pattern.linear)
        if reason is not None:
            return False, reason
    return True


def transform_linear_bias(pattern: Pattern) -> None:
    """Inserts the ``linear`` with the folded weight and bias; the framework removes the old ops."""
    linear, add_or_sub = pattern.linear, pattern.add_or_sub
    d_out = linear.bias.val.shape[0]
    bias = np.reshape(pattern.operand("add_or_sub", "y").val, (d_out,))
    compressed = linear.weight.val is None
    linear_bias, weight = linear.bias.val, linear.weight if compressed else linear.weight.val
    if add_or_sub.op_type == "sub":
        if not _negates_weight(pattern):  # linear - c
            bias = -bias
        elif compressed:  # c - linear: -W in the weight's constexpr ops
            linear_bias = -linear_bias
            weight = scale_compressed(weight, np.full((1, 1), -1.0), before_op=linear)
        else:  # c - linear
            linear_bias, weight = -linear_bias, -weight
    fused = mb.linear(
        x=linear.x,
        weight=weight,
        bias=linear_bias + bias,
        name=add_or_sub.outputs[0].name,
        before_op=linear,
    )
    pattern.replace_output(fused, force=compressed)  # a negated W's new constexpr ops replace the old


register_generic_pass(
    ops_arrangement=linear_bias_pattern,
    var_constraints=linear_bias_constraints,
    transform_pattern=transform_linear_bias,
    pass_name="fuse_linear_bias",
    namespace="common",
    alternatives={"add_or_sub": ["add", "sub"]},
    commutative=["add_or_sub"],  # sub too: the transform reads which side the op is on
    const_rules={"linear.weight": "weight", "linear.bias": "const", "add_or_sub.y": "const"},
    name="linear_bias",
)
