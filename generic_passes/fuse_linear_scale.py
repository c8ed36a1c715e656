"""``generic::fuse_linear_scale``: a ``linear`` times (divided by) a constant folds into its weight and bias.

Layer scales (ConvNeXt's ``gamma * pwconv2(x)``, the ``LayerScale`` of DeiT III, CaiT and timm's vision
transformers) multiply a ``linear``'s output by one constant per output feature. coremltools folds such a
factor into a convolution (``common::fuse_conv_scale``) but not into a ``linear``.

Math: output feature ``o`` of ``linear(x, W, b) = x @ W.T + b`` is ``x @ W[o] + b[o]``, linear in row
``o`` of ``W`` and in ``b[o]``, so scaling it by ``s[o]`` (or one ``s`` for all) scales that row and
that bias::

    linear(x, W, b) * s  =  linear(x, W * s[:, None], b * s)
    linear(x, W, b) / s  =  linear(x, W / s[:, None], b / s)

``mul`` and ``real_div`` are alternatives of one pattern op; the matcher tries both operand orders of
``mul`` (``s * linear`` is the same match) and one of ``real_div``, so ``s / linear`` (not linear in the
``linear``) never matches::

    x --> linear(W, b) --> mul_or_div(s) --> y      s: a scalar, or Dout values along the last axis
                                                       ((Dout,), (1, Dout), (1, 1, Dout), ...)
    becomes:

    x --> linear(W', b') --> y

``s`` may not have more dimensions than the ``linear``'s output (it would broadcast the output to a
higher rank). The new weight and bias are computed in float64 and rounded once to the weight's dtype
(float16 in a float16 program): ``W * s`` is then exactly the correctly rounded product.

A compressed ``W`` (``constexpr_*`` ops: palettized, int8, ...) takes the factors without being
decompressed, into its per-channel scale or LUT, or a new per-channel ``constexpr_blockwise_shift_scale``
after it (iOS18); where none applies the match is refused with the reason (``_compressed``).

The new ``linear`` is inserted before the old one and takes the name of the output it replaces. The
pass runs right after ``common::fuse_matmul_weight_bias`` (which makes the ``linear`` ops of
``matmul`` + ``add``) while ``ENABLE_EXPERIMENTAL_PASSES=1``, so that ``common::fuse_linear_bias``,
next in the pipeline, still folds a constant added after the scale, and so that
``generic::remove_channels_last_round_trip`` sees ConvNeXt's MLP without the ``mul``.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, register_generic_pass

from ._compressed import is_compressed, scale_compressed, scale_refusal

__all__ = ["linear_scale_pattern", "linear_scale_constraints", "transform_linear_scale"]

_D_OUT, _D_IN = 4, 3


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), _D_IN))])
def linear_scale_pattern(x):
    linear = mb.linear(
        x=x,
        weight=np.zeros((_D_OUT, _D_IN), dtype=np.float32),
        bias=np.zeros(_D_OUT, dtype=np.float32),
        name="linear",
    )
    return mb.mul(x=linear, y=np.ones(_D_OUT, dtype=np.float32), name="mul_or_div")


def _factors(pattern: Pattern) -> np.ndarray | None:
    """``s`` as ``Dout`` float64 factors, or None if its layout is not one value per output feature."""
    linear = pattern.linear
    d_out = int(linear.weight.shape[0])
    scale = np.asarray(pattern.operand("mul_or_div", "y").val, dtype=np.float64)
    if scale.size == 1:
        return np.full(d_out, scale.reshape(()))
    if scale.ndim > linear.outputs[0].rank:
        return None
    if scale.shape[-1] != d_out or scale.size != d_out:
        return None
    return scale.reshape(d_out)


def linear_scale_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """``s`` is a scalar or ``Dout`` values along the last axis, and a compressed ``W`` can take per-row
    factors."""
    linear = pattern.linear
    if _factors(pattern) is None:
        shape = np.shape(pattern.operand("mul_or_div", "y").val)
        return False, f"s of shape {shape} is neither a scalar nor one value per output feature"
    weight = linear.weight
    if weight.val is None:
        if not is_compressed(weight):
            return False, f"the weight {weight.name} of {linear.name} is neither a constant nor compressed"
        reason = scale_refusal(weight, (int(weight.shape[0]), 1), linear)
        if reason is not None:
            return False, reason
    return True


def transform_linear_scale(pattern: Pattern) -> None:
    """Inserts the ``linear`` with the scaled weight and bias; the framework removes the old ops."""
    linear, mul_or_div = pattern.linear, pattern.mul_or_div
    factors = _factors(pattern)
    assert factors is not None, "linear_scale_constraints refuses a scale of another layout"
    divide = mul_or_div.op_type == "real_div"
    bias = linear.bias.val
    new_bias = (bias / factors if divide else bias * factors).astype(bias.dtype)
    compressed = linear.weight.val is None
    if compressed:
        per_row = (1.0 / factors if divide else factors).reshape(-1, 1)
        weight = scale_compressed(linear.weight, per_row, before_op=linear)
    else:
        value = linear.weight.val
        wide = value.astype(np.float64)
        rows = factors.reshape(-1, 1)
        weight = (wide / rows if divide else wide * rows).astype(value.dtype)
    fused = mb.linear(
        x=linear.x, weight=weight, bias=new_bias, name=mul_or_div.outputs[0].name, before_op=linear
    )
    pattern.replace_output(fused, force=compressed)  # a compressed W's new constexpr ops replace the old


register_generic_pass(
    ops_arrangement=linear_scale_pattern,
    var_constraints=linear_scale_constraints,
    transform_pattern=transform_linear_scale,
    pass_name="fuse_linear_scale",
    namespace="generic",
    alternatives={"mul_or_div": ["mul", "real_div"]},
    const_rules={"linear.weight": "weight", "linear.bias": "const", "mul_or_div.y": "const"},
    name="linear_scale",
    run_after="common::fuse_matmul_weight_bias",
)
