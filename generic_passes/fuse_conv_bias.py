"""``common::fuse_conv_bias``: a constant added to (subtracted from) a convolution goes into its bias.

Math: ``conv(x, W, b)`` adds ``b[o]`` to output channel ``o`` (axis 1); ``conv_transpose`` likewise. A
constant ``c`` that is one value per output channel (or one value for all) therefore folds into ``b``::

    conv(x, W, b) + c  =  conv(x, W, b + c)        conv(x, W, b) - c  =  conv(x, W, b - c)
    c - conv(x, W, b)  =  conv(x, -W, c - b)       (pattern 2 only, as in coremltools)

``conv`` and ``conv_transpose`` are alternatives of one pattern op, ``add`` and ``sub`` of another, and
the matcher tries both operand orders, so two patterns cover every variant (coremltools' experimental
generic version of this pass needed eight)::

    Pattern 1:  x --> conv --> add_or_sub(c) --> y
                c: a scalar, or (C, 1, ..., 1) / (1, C, 1, ..., 1), C = 1 or Cout (channel axis only)

        becomes:  x --> conv(bias = b +/- c) --> y

    Pattern 2:  x --> conv --> transpose(perm) --> add_or_sub(c) --> y
                c: a scalar, or Cout values on the axis where perm put the channels

        becomes:  x --> conv(W', b') --> transpose(perm) --> y

The ops coremltools inserts, where it inserts them. Pattern 1: a new ``const`` bias and the ``conv``
(with all other inputs, the weight included, shared with the old one), named after the output.
Pattern 2: a ``conv`` with fresh weight and bias constants (unnamed, as in coremltools), then the
``transpose`` named after the output.

Refusals kept from coremltools: ``c`` not a constant or of another layout; the input rank not 3 to 5;
the existing bias not a constant; ``c - conv`` in pattern 1. Where coremltools 9.0 raises or is wrong,
this pass differs (each case has a test):

* ``c`` with more dimensions than the output (it broadcasts the output to a higher rank): coremltools
  fuses and the output loses dimensions; refused here.
* pattern 1, no bias, scalar ``c`` on a grouped ``conv_transpose``: coremltools builds ``weight.shape[1]``
  bias values instead of ``Cout = weight.shape[1] * groups`` and raises; fused here. The output-channel
  count is read from the weight's (static) shape, so a non-constant weight is fine here (coremltools
  reads the weight's value and refuses).
* pattern 1, ``sub``: coremltools negates ``c`` in place (through a view), changing the constant for
  any other op that reads it; here a new array is made.
* pattern 2, ``perm`` with negative axes: coremltools looks ``1`` up in the raw ``perm`` and raises;
  fused here.
* pattern 2, ``c`` of fewer dimensions than the channel axis needs: coremltools raises ``IndexError``;
  refused here. A non-constant weight (pattern 2 writes a new one) or existing bias: coremltools
  raises; refused here.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, types

from pattern_infra import Pattern, register_generic_pass

from ._conv_common import has_constant_weight_and_bias, rebuild_conv

__all__ = [
    "conv_bias_pattern",
    "conv_transpose_bias_pattern",
    "conv_bias_constraints",
    "transform_conv_bias",
    "conv_transpose_bias_constraints",
    "transform_conv_transpose_bias",
]

_C_IN, _C_OUT = 2, 3
_WEIGHT = np.zeros((_C_OUT, _C_IN, 1, 1), dtype=np.float32)


@mb.program(input_specs=[mb.TensorSpec(shape=(1, _C_IN, 4, 4))])
def conv_bias_pattern(x):
    conv = mb.conv(x=x, weight=_WEIGHT, name="conv")
    return mb.add(x=conv, y=np.zeros((_C_OUT, 1, 1), dtype=np.float32), name="add_or_sub")


@mb.program(input_specs=[mb.TensorSpec(shape=(1, _C_IN, 4, 4))])
def conv_transpose_bias_pattern(x):
    conv = mb.conv(x=x, weight=_WEIGHT, name="conv")
    transpose = mb.transpose(x=conv, perm=[0, 2, 3, 1], name="transpose")
    return mb.add(x=transpose, y=np.zeros(_C_OUT, dtype=np.float32), name="add_or_sub")


def _c_out(conv: Operation) -> int | None:
    """Output channels, from the weight's static shape (conv: [Cout, ...]; conv_transpose: [Cin,
    Cout / groups, ...])."""
    shape = conv.weight.shape
    groups = conv.groups.val
    if groups is None:
        return None
    c_out = shape[0] if conv.op_type == "conv" else shape[1] * int(groups)
    return int(c_out) if isinstance(c_out, (int, np.integer)) else None


def _is_first(pattern: Pattern, producer: Operation) -> bool:
    """Whether ``producer``'s output is the ``x`` of the ``add_or_sub`` (else ``c`` is)."""
    return pattern.add_or_sub.x is producer.outputs[0]


# -- pattern 1: conv --> add/sub ----------------------------------------------------------------------


def _channel_bias(pattern: Pattern) -> np.ndarray | None:
    """``c`` as per-channel values to add (sign applied), of shape (1,) or (C,); None if not foldable."""
    conv, add_or_sub = pattern.conv, pattern.add_or_sub
    value = pattern.operand("add_or_sub", "y").val
    rank = conv.x.rank
    if rank not in (3, 4, 5):
        return None
    if not isinstance(value, np.ndarray):  # a scalar
        bias = np.array([value])
    else:
        if len(np.squeeze(value).shape) > 1:
            return None  # varies along two axes
        if value.ndim > rank:
            return None  # would broadcast the output to a higher rank
        if value.ndim == rank and value.shape[0] != 1:
            return None  # varies along the batch axis
        if np.prod(value.shape[-(rank - 2) :]) != 1:
            return None  # varies along a spatial axis
        bias = np.squeeze(value).copy()  # a copy: never alias (or change) the program's constant
    return -bias if add_or_sub.op_type == "sub" else bias


def _new_bias(pattern: Pattern) -> np.ndarray | None:
    """The folded bias vector, or None if it cannot be computed."""
    conv = pattern.conv
    bias = _channel_bias(pattern)
    if bias is None:
        return None
    old = conv.inputs.get("bias")
    if old is not None:
        if old.val is None:
            return None
        try:
            return old.val + bias
        except ValueError:
            return None
    if np.prod(bias.shape) == 1:
        c_out = _c_out(conv)
        return None if c_out is None else np.broadcast_to(bias, (c_out,))
    return bias


def conv_bias_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """``c`` is foldable (see :func:`_channel_bias`) and ``sub`` has the ``conv`` on its left.

    Returns:
        True, or ``(False, reason)``.
    """
    if pattern.add_or_sub.op_type == "sub" and not _is_first(pattern, pattern.conv):
        return False, "the convolution is subtracted (c - conv)"
    if _new_bias(pattern) is None:
        return False, "the constant is not a scalar or one value per output channel"
    return True


def transform_conv_bias(pattern: Pattern) -> None:
    """Inserts the new bias constant and the ``conv`` reading it; the framework removes the old ops."""
    conv = pattern.conv
    bias = _new_bias(pattern)
    assert bias is not None, "conv_bias_constraints refused a bias it cannot fold"
    if bias.dtype not in (np.float32, np.float16):
        bias = bias.astype(types.nptype_from_builtin(conv.weight.dtype))
    bias_var = mb.const(val=bias, before_op=conv)
    fused = rebuild_conv(conv, bias=bias_var, name=pattern.add_or_sub.outputs[0].name)
    pattern.replace_output(fused)


# -- pattern 2: conv --> transpose --> add/sub --------------------------------------------------------


def _transposed_channel_bias(pattern: Pattern) -> float | np.ndarray | None:
    """``c`` as a scalar or a (Cout,) vector in the conv's channel order; None if not foldable."""
    conv, transpose = pattern.conv, pattern.transpose
    bias = pattern.operand("add_or_sub", "y").val
    c_out = conv.outputs[0].shape[1]
    if isinstance(bias, np.ndarray):
        if bias.shape == ():
            return bias.tolist()
        if np.prod(bias.shape) == 1:
            return np.squeeze(bias).tolist()
    else:
        return bias
    rank = transpose.outputs[0].rank
    if np.prod(bias.shape) != c_out or bias.ndim > rank:
        return None
    channel_axis = list(np.asarray(transpose.perm.val).reshape(-1) % rank).index(1) - rank
    if bias.ndim < -channel_axis or bias.shape[channel_axis] != c_out:
        return None
    return np.reshape(bias, (c_out,))


def conv_transpose_bias_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Constant weight and bias, integer ``Cout``, and ``c`` along the channels' new axis.

    Returns:
        True, or ``(False, reason)``.
    """
    conv = pattern.conv
    if not has_constant_weight_and_bias(conv):
        return False, "the convolution's weight or bias is not a constant"
    if not isinstance(conv.outputs[0].shape[1], (int, np.integer)):
        return False, "the output channels are symbolic"
    if pattern.transpose.perm.val is None:
        return False, "the transpose's perm is not a constant"
    if _transposed_channel_bias(pattern) is None:
        return False, "the constant is not along the channels' new axis"
    return True


def transform_conv_transpose_bias(pattern: Pattern) -> None:
    """Inserts a ``conv`` with the folded weight and bias, then the ``transpose`` named after the output."""
    conv, transpose, add_or_sub = pattern.conv, pattern.transpose, pattern.add_or_sub
    weight = conv.weight.val
    c_out = conv.outputs[0].shape[1]
    conv_bias = np.zeros(c_out).astype(weight.dtype) if conv.bias is None else conv.bias.val
    bias = _transposed_channel_bias(pattern)
    assert bias is not None, "the constraint refused a bias it cannot fold"
    if add_or_sub.op_type == "sub":
        if _is_first(pattern, transpose):  # transpose(conv) - c
            bias = -bias
        else:  # c - transpose(conv)
            conv_bias, weight = -conv_bias, -weight
    fused = rebuild_conv(conv, weight=weight, bias=conv_bias + bias)
    kwargs = {k: v for k, v in transpose.inputs.items() if k != "x"}
    fused = mb.transpose(x=fused, **kwargs, name=add_or_sub.outputs[0].name, before_op=transpose)
    pattern.replace_output(fused)


for _pattern, _constraints, _transform, _priority, _name in (
    (conv_bias_pattern, conv_bias_constraints, transform_conv_bias, 1, "conv_bias"),
    (
        conv_transpose_bias_pattern,
        conv_transpose_bias_constraints,
        transform_conv_transpose_bias,
        0,
        "conv_transpose_bias",
    ),
):
    register_generic_pass(
        ops_arrangement=_pattern,
        var_constraints=_constraints,
        transform_pattern=_transform,
        pass_name="fuse_conv_bias",
        namespace="common",
        alternatives={"conv": ["conv", "conv_transpose"], "add_or_sub": ["add", "sub"]},
        commutative=["add_or_sub"],  # sub too: the transform reads which side the op is on
        const_rules={"add_or_sub.y": "const"},
        priority=_priority,
        name=_name,
    )
