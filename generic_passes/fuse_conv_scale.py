"""``common::fuse_conv_scale``: a convolution times (divided by) a constant folds into its weight and bias.

Math: every output channel ``o`` of ``conv(x, W, b)`` is linear in ``W[o]`` plus ``b[o]``, so scaling
channel ``o`` by ``s[o]`` (or one ``s`` for all) is scaling ``W``'s rows and ``b``::

    conv(x, W, b) * s  =  conv(x, W * s[o], b * s)
    conv(x, W, b) / s  =  conv(x, W * (1/s)[o], b * (1/s))

For ``conv`` the channel ``o`` is ``W``'s axis 0; for ``conv_transpose`` (weight ``[Cin, Cout/groups,
...]``) it is ``group * Cout/groups + W``'s axis 1, where ``group`` is the input channel's group.

``conv`` and ``conv_transpose`` are alternatives of one pattern op, ``mul`` and ``real_div`` of another;
the matcher tries both operand orders, so one pattern covers them all::

    x --> conv --> mul_or_div(s) --> y       s: a scalar, (1,), or Cout values as (Cout, 1, ..., 1) or
                                                (1, Cout, 1, ..., 1)
    becomes:

    x --> conv(W', b') --> y

As coremltools does, the ``conv`` is inserted before the old one, takes the name of the output it
replaces, and receives the new weight and bias as fresh constants (``<name>_weight_0``, ``<name>_bias_0``);
the arithmetic and the dtypes are coremltools' (the result cast to the weight's dtype), so the constants
are bit for bit the same.

A compressed weight (``constexpr_*`` ops, e.g. palettized or int8) takes the factors without being
decompressed: into its per-channel scale or LUT, or a new per-channel ``constexpr_blockwise_shift_scale``
after it (iOS18); where none applies the match is refused with the reason (``_compressed``). coremltools
leaves such a conv alone.

Refusals kept from coremltools: ``s`` not a constant or of another layout; a non-constant weight. Where
coremltools 9.0 raises or is wrong, this pass differs (each case has a test):

* ``s / conv``: coremltools fuses it as ``conv / s``; refused here (not linear in the conv).
* grouped ``conv_transpose`` with per-channel ``s``: coremltools scales the wrong output channels
  (its reshape of ``[Cout/groups, Cin, ...]`` to ``[Cout, Cin/groups, ...]`` interleaves the groups);
  the channels are right here.
* 3-D ``conv_transpose`` with per-channel ``s``: coremltools raises (a 4-axis transpose on a 5-D
  weight); fused here.
* a non-constant existing bias: coremltools raises; refused here.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb

from pattern_infra import Pattern, register_generic_pass

from ._conv_common import (
    bias_or_zeros,
    c_out_of,
    rebuild_conv,
    scale_output_channels,
    scale_weight,
    weight_refusal,
)

__all__ = [
    "conv_scale_pattern",
    "conv_scale_constraints",
    "transform_conv_scale",
    "c_out_of",  # defined in _conv_common, shared with fuse_conv_batchnorm
    "scale_output_channels",  # likewise
]

_C_IN, _C_OUT = 2, 3


@mb.program(input_specs=[mb.TensorSpec(shape=(1, _C_IN, 4, 4))])
def conv_scale_pattern(x):
    conv = mb.conv(x=x, weight=np.zeros((_C_OUT, _C_IN, 1, 1), dtype=np.float32), name="conv")
    return mb.mul(x=conv, y=np.ones((_C_OUT, 1, 1), dtype=np.float32), name="mul_or_div")


def _scale(pattern: Pattern) -> tuple[bool, float | np.ndarray] | None:
    """(is scalar, value) of ``s`` as coremltools reads it, or None if its layout cannot fold."""
    conv = pattern.conv
    scale = pattern.operand("mul_or_div", "y").val
    is_scalar = True
    if isinstance(scale, np.ndarray):
        if scale.shape == ():
            scale = scale.tolist()
        elif scale.shape == (1,):
            scale = scale[0]
        else:
            is_scalar = False
    if not is_scalar:
        weight_rank = conv.weight.rank
        c_out = c_out_of(conv, conv.weight)
        if np.prod(scale.shape) != c_out:
            return None
        if scale.ndim == weight_rank:
            if scale.shape[1] != c_out:
                return None
        elif scale.ndim == weight_rank - 1:
            if scale.shape[0] != c_out:
                return None
        else:
            return None
    return is_scalar, scale


def conv_scale_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Constant or foldable compressed weight, constant bias, ``s`` of a foldable layout, and no division
    by the ``conv``."""
    conv, mul_or_div = pattern.conv, pattern.mul_or_div
    if mul_or_div.op_type == "real_div" and mul_or_div.x is not conv.outputs[0]:
        return False, "s / conv is not linear in the conv"
    scale = _scale(pattern)
    if scale is None:
        return False, "s is neither a scalar nor one value per output channel"
    reason = weight_refusal(conv, scalar=scale[0])
    return (False, reason) if reason is not None else True


def transform_conv_scale(pattern: Pattern) -> None:
    """Inserts the ``conv`` with the scaled weight and bias; the framework removes the old ops."""
    conv, mul_or_div = pattern.conv, pattern.mul_or_div
    scaling = _scale(pattern)
    assert scaling is not None, "conv_scale_constraints refused a scale of no foldable layout"
    is_scalar, scale = scaling
    if mul_or_div.op_type == "real_div":
        scale = 1.0 / scale
    if conv.weight.val is None:  # compressed: the factor goes into its constexpr ops
        bias, factors = bias_or_zeros(conv, conv.weight), np.reshape(scale, -1)
        new_bias = np.array(bias * factors).astype(bias.dtype)
        new_weight = scale_weight(conv, factors)
        fused = rebuild_conv(conv, weight=new_weight, bias=new_bias, name=mul_or_div.outputs[0].name)
        pattern.replace_output(fused, force=True)  # the old constexpr ops give way to the new ones
        return
    weight = conv.weight.val
    dtype = weight.dtype
    c_out = c_out_of(conv, weight)
    bias = bias_or_zeros(conv, weight)
    if is_scalar:
        new_bias = np.array(bias * scale).astype(dtype)
        new_weight = np.array(weight * scale).astype(dtype)
    else:
        scale = np.reshape(scale, (c_out,))
        new_bias = np.array(bias * scale).astype(dtype)
        new_weight = scale_output_channels(conv, weight, scale).astype(dtype)
    fused = rebuild_conv(conv, weight=new_weight, bias=new_bias, name=mul_or_div.outputs[0].name)
    pattern.replace_output(fused)


register_generic_pass(
    ops_arrangement=conv_scale_pattern,
    var_constraints=conv_scale_constraints,
    transform_pattern=transform_conv_scale,
    pass_name="fuse_conv_scale",
    namespace="common",
    alternatives={"conv": ["conv", "conv_transpose"], "mul_or_div": ["mul", "real_div"]},
    const_rules={"mul_or_div.y": "const"},
    name="conv_scale",
)
