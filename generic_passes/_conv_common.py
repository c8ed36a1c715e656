"""What the convolution fusions share: output channels, per-channel weight scaling, rebuilding a ``conv``.

``fuse_conv_bias``, ``fuse_conv_scale`` and ``fuse_conv_batchnorm`` all replace a ``conv`` or
``conv_transpose`` by a new one of the same type with a new weight and/or bias. The weight layouts::

    conv:            [Cout, Cin / groups, k...]    output channel o is the weight's axis 0
    conv_transpose:  [Cin, Cout / groups, k...]    output channel o = group * Cout/groups + axis 1,
                                                   group = the input channel's group

Not a pass module (the leading underscore keeps ``generic_passes`` from importing it as one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, Var

__all__ = [
    "c_out_of",
    "scale_output_channels",
    "has_constant_weight_and_bias",
    "bias_or_zeros",
    "rebuild_conv",
]


def c_out_of(conv: Operation, weight: np.ndarray) -> int:
    """Output channels of ``conv`` (``conv`` or ``conv_transpose``) with weight ``weight``."""
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


def bias_or_zeros(conv: Operation, weight: np.ndarray) -> np.ndarray:
    """``conv``'s bias, or ``Cout`` zeros without one, in the dtype of ``weight`` (``conv``'s weight value)."""
    bias = np.zeros(c_out_of(conv, weight)) if conv.bias is None else conv.bias.val
    return bias.astype(weight.dtype)


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
