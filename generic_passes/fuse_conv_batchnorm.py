"""``common::fuse_conv_batchnorm``: a ``batch_norm`` after a convolution folds into its weight and bias.

Math: ``batch_norm`` is, per channel ``o``, the affine map ``y = s[o] * (x - mean[o]) + beta[o]`` with
``s = gamma / sqrt(variance + epsilon)``; applied to ``conv(x, W, b)`` it is a convolution again::

    batch_norm(conv(x, W, b))  =  conv(x, W * s[o], s * (b - mean) + beta)

with ``o`` the output channel of each weight element (``W``'s axis 0 for ``conv``; for
``conv_transpose``, weight ``[Cin, Cout/groups, ...]``, ``group * Cout/groups + W``'s axis 1).

``conv`` and ``conv_transpose`` are alternatives of one pattern op::

    x --> conv --> batch_norm(mean, variance, gamma, beta, epsilon) --> y

    becomes:

    x --> conv(W', b') --> y

As coremltools does, the new weight and bias are two ``const`` ops (unnamed, weight first) inserted
before the old ``conv``, then the ``conv`` reading them, named after the output; the arithmetic and dtypes
are coremltools' (per-channel ``s`` in the parameters' dtype, results cast to the weight's dtype), so
the constants are bit for bit the same.

A compressed weight (``constexpr_*`` ops, e.g. palettized or int8) takes the per-channel factors ``s``
without being decompressed: into its per-channel scale or LUT, or a new per-channel
``constexpr_blockwise_shift_scale`` after it (iOS18); where none applies the match is refused with the
reason (``_compressed``). coremltools leaves such a conv alone.

Refusals kept from coremltools: a non-constant weight, a non-constant existing bias.
Where coremltools 9.0 raises or is wrong, this pass differs (each case has a test):

* ``batch_norm`` without ``gamma`` / ``beta`` (they are optional): coremltools raises
  (``None.val``); here they are 1 and 0.
* grouped ``conv_transpose``: coremltools applies the per-channel factors to the wrong output channels
  (its reshape interleaves the groups); the channels are right here.
* a ``batch_norm`` parameter without a value (a ``constexpr`` one): coremltools raises; refused here.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb

from pattern_infra import Pattern, register_generic_pass

from ._conv_common import bias_or_zeros, rebuild_conv, scale_output_channels, scale_weight, weight_refusal

__all__ = ["conv_batchnorm_pattern", "conv_batchnorm_constraints", "transform_conv_batchnorm"]

_C_IN, _C_OUT = 2, 3


@mb.program(input_specs=[mb.TensorSpec(shape=(1, _C_IN, 4, 4))])
def conv_batchnorm_pattern(x):
    conv = mb.conv(x=x, weight=np.zeros((_C_OUT, _C_IN, 1, 1), dtype=np.float32), name="conv")
    return mb.batch_norm(
        x=conv,
        mean=np.zeros(_C_OUT, dtype=np.float32),
        variance=np.ones(_C_OUT, dtype=np.float32),
        name="batch_norm",
    )


def _bn_params(pattern: Pattern) -> tuple[np.ndarray, ...] | None:
    """(gamma, beta, mean, variance, epsilon) as arrays, gamma / beta defaulted; None if one has no value."""
    bn = pattern.batch_norm
    mean, variance, epsilon = bn.mean.val, bn.variance.val, bn.epsilon.val
    if mean is None or variance is None or epsilon is None:
        return None
    gamma = np.ones_like(variance) if bn.gamma is None else bn.gamma.val
    beta = np.zeros_like(mean) if bn.beta is None else bn.beta.val
    if gamma is None or beta is None:
        return None
    return gamma, beta, mean, variance, epsilon


def conv_batchnorm_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Constant (or foldable compressed) weight, constant bias and normalization parameters."""
    if _bn_params(pattern) is None:
        return False, "a batch_norm parameter is not a compile-time constant"
    reason = weight_refusal(pattern.conv, scalar=False)
    return (False, reason) if reason is not None else True


def transform_conv_batchnorm(pattern: Pattern) -> None:
    """Inserts the folded weight and bias constants and the ``conv``; the framework removes the old ops."""
    conv, bn = pattern.conv, pattern.batch_norm
    params = _bn_params(pattern)
    assert params is not None, "conv_batchnorm_constraints refused parameters without a value"
    gamma, beta, mean, variance, epsilon = params
    scale = gamma / np.sqrt(variance + epsilon)
    if conv.weight.val is None:  # compressed: the factors go into its constexpr ops
        bias = bias_or_zeros(conv, conv.weight)
        new_bias = (scale * (bias - mean) + beta).astype(bias.dtype)
        weight_var = scale_weight(conv, scale)
        bias_var = mb.const(val=new_bias, before_op=conv)
        fused = rebuild_conv(conv, weight=weight_var, bias=bias_var, name=bn.outputs[0].name)
        pattern.replace_output(fused, force=True)  # the old constexpr ops give way to the new ones
        return
    weight = conv.weight.val
    dtype = weight.dtype
    bias = bias_or_zeros(conv, weight)
    new_weight = scale_output_channels(conv, weight, scale).astype(dtype)
    new_bias = (scale * (bias - mean) + beta).astype(dtype)

    weight_var = mb.const(val=new_weight, before_op=conv)
    bias_var = mb.const(val=new_bias, before_op=conv)
    fused = rebuild_conv(conv, weight=weight_var, bias=bias_var, name=bn.outputs[0].name)
    pattern.replace_output(fused)


register_generic_pass(
    ops_arrangement=conv_batchnorm_pattern,
    var_constraints=conv_batchnorm_constraints,
    transform_pattern=transform_conv_batchnorm,
    pass_name="fuse_conv_batchnorm",
    namespace="common",
    alternatives={"conv": ["conv", "conv_transpose"]},
    name="conv_batchnorm",
)
