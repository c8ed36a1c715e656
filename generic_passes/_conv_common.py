"""What the convolution fusions share: output channels, per-channel weight scaling, rebuilding a ``conv``.

``fuse_conv_bias``, ``fuse_conv_scale`` and ``fuse_conv_batchnorm`` all replace a ``conv`` or
``conv_transpose`` by a new one of the same type with a new weight and/or bias. The weight layouts::

    conv:            [Cout, Cin / groups, k...]    output channel o is the weight's axis 0
    conv_transpose:  [Cin, Cout / groups, k...]    output channel o = group * Cout/groups + axis 1,
                                                   group = the input channel's group

A compressed weight (the output of ``constexpr_*`` ops) takes the per-channel factors without being
decompressed (``_compressed.scale_compressed``); :func:`weight_refusal` says when it cannot.

Not a pass module (the leading underscore keeps ``generic_passes`` from importing it as one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, Var, types

from ._compressed import is_compressed, scale_compressed, scale_refusal

__all__ = [
    "c_out_of",
    "scale_output_channels",
    "has_constant_weight_and_bias",
    "bias_or_zeros",
    "rebuild_conv",
    "channel_factor",
    "weight_refusal",
    "scale_weight",
]


def c_out_of(conv: Operation, weight: np.ndarray | Var) -> int:
    """Output channels of ``conv`` (``conv`` or ``conv_transpose``) with weight ``weight`` (its value or
    the var)."""
    if conv.op_type == "conv_transpose":
        return weight.shape[1] * int(conv.groups.val)
    return weight.shape[0]


def scale_output_channels(conv: Operation, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``weight`` with output channel ``o`` multiplied by ``scale[o]`` (``scale`` of shape (Cout,)).

    Each element is multiplied once by its channel's factor, so the result is bit for bit what a loop
    over channels gives.
    """
    if conv.op_type != "conv_transpose":
        return weight * scale.reshape((-1,) + (1,) * (weight.ndim - 1))
    # conv_transpose weight: [Cin, Cout/groups, ...]; input channel i, column j feed output channel
    # (i // (Cin/groups)) * (Cout/groups) + j
    groups = int(conv.groups.val)
    c_in, c_out_per_group = weight.shape[0], weight.shape[1]
    grouped = weight.reshape((groups, c_in // groups) + weight.shape[1:])
    factors = scale.reshape((groups, 1, c_out_per_group) + (1,) * (weight.ndim - 2))
    return (grouped * factors).reshape(weight.shape)


def has_constant_weight_and_bias(conv: Operation) -> bool:
    """Whether the weight, and the bias if there is one, have compile-time values (a ``constexpr`` has
    none)."""
    if conv.weight.val is None:
        return False
    return conv.bias is None or conv.bias.val is not None


def bias_or_zeros(conv: Operation, weight: np.ndarray | Var) -> np.ndarray:
    """``conv``'s bias, or ``Cout`` zeros without one, in the dtype of ``weight`` (``conv``'s weight value,
    or the var of a compressed one)."""
    bias = np.zeros(c_out_of(conv, weight)) if conv.bias is None else conv.bias.val
    dtype = weight.dtype if isinstance(weight, np.ndarray) else types.nptype_from_builtin(weight.dtype)
    return bias.astype(dtype)


def channel_factor(conv: Operation, scale: np.ndarray) -> np.ndarray:
    """The factor multiplying ``conv``'s weight by ``scale`` (a scalar, or ``Cout`` values) per output
    channel: the weight's rank, 1 on the kernel axes (and on every axis for a scalar)."""
    shape = tuple(conv.weight.shape)
    scale = np.asarray(scale)
    if scale.size == 1:
        return np.full((1,) * len(shape), scale.reshape(()))
    if conv.op_type == "conv_transpose" and int(conv.groups.val) > 1:
        ones = np.ones(shape[:2] + (1,) * (len(shape) - 2))
    elif conv.op_type == "conv_transpose":
        ones = np.ones((1, shape[1]) + (1,) * (len(shape) - 2))
    else:
        ones = np.ones(shape[:1] + (1,) * (len(shape) - 1))
    return scale_output_channels(conv, ones, scale.reshape(-1))


def weight_refusal(conv: Operation, scalar: bool) -> str | None:
    """Why ``conv``'s weight and bias cannot take per-channel factors (or one factor, ``scalar``), or None.

    A plain constant weight always can; a compressed one where ``_compressed`` can fold the factor; the
    bias must be a plain constant."""
    if conv.bias is not None and conv.bias.val is None:
        return f"the bias {conv.bias.name} of {conv.name} is not a compile-time constant"
    weight = conv.weight
    if weight.val is not None:
        return None
    if not is_compressed(weight):
        return f"the weight {weight.name} of {conv.name} is neither a constant nor a compressed weight"
    c_out = c_out_of(conv, weight)
    factor_shape = channel_factor(conv, np.ones(1 if scalar else c_out)).shape
    return scale_refusal(weight, factor_shape, conv)


def scale_weight(conv: Operation, scale: np.ndarray) -> Var:
    """``conv``'s compressed weight times ``scale`` (scalar or ``Cout`` values) per output channel, as new
    ``constexpr_*`` ops before ``conv`` (never decompressed)."""
    return scale_compressed(conv.weight, channel_factor(conv, scale), before_op=conv)


def rebuild_conv(conv: Operation, *, name: str | None = None, **replaced: Any) -> Var:
    """A new op of ``conv``'s type before ``conv``, with its inputs but for ``replaced``.

    Args:
        conv: The ``conv`` or ``conv_transpose`` to replace.
        name: The new op's name (default: a fresh one from the builder).
        **replaced: Inputs to set, e.g. ``weight=...``, ``bias=...``.

    Returns:
        The new op's output.
    """
    kwargs = {k: v for k, v in conv.inputs.items() if k not in replaced}
    op = mb.conv if conv.op_type == "conv" else mb.conv_transpose
    if name is None:
        return op(**kwargs, **replaced, before_op=conv)
    return op(**kwargs, **replaced, name=name, before_op=conv)
