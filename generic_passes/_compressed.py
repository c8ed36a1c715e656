"""Folding a scale into a compressed weight without decompressing it.

A compressed weight is the output of a chain of ``constexpr_*`` ops (``is_compressed``); it has no value
at compile time, and turning it into a plain ``const`` would grow the weight file back to its
uncompressed size. A per-output-channel factor ``f`` (an array of the weight's rank, each axis 1 or the
weight's) multiplies the weight where one of iOS18's ops holds the factor::

    constexpr_blockwise_shift_scale(data, scale, offset)    scale * (data - offset): scale' = scale * f
                                                            (scale and offset repeated to f's blocks)
    constexpr_lut_to_dense(indices, lut)                    the LUT entries times f, where the LUT has
                                                            one palette per channel f varies along
    any other (or a LUT shared across channels), iOS18      constexpr_blockwise_shift_scale(w, scale=f)
    constexpr_affine_dequantize (iOS16), per axis           scale' = scale * f along its axis

The new ops reuse the old ones' data (``data``, ``indices``): only the small scale or LUT is new.

Not a pass module (the leading underscore keeps ``generic_passes`` from importing it as one).
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, Var, types

from pattern_infra.language import is_compressed

__all__ = ["compressed_by", "is_compressed", "scale_refusal", "scale_compressed"]

_IOS18 = 18


def compressed_by(var: Var) -> str | None:
    """The ``constexpr_*`` op type producing a compressed weight, or None for any other var."""
    return var.op.op_type if is_compressed(var) else None


def _opset(op: Operation) -> int:
    """The iOS version of the opset of the function holding ``op`` (e.g. 18), 0 when unknown."""
    block = op.enclosing_block
    while block is not None and not hasattr(block, "opset_version"):
        block = block.outer_op.enclosing_block if block.outer_op is not None else None
    version = getattr(block, "opset_version", None)
    name = getattr(version, "name", "")
    return int(name[3:]) if name.startswith("iOS") else 0


def _varying_axes(factor_shape: tuple[int, ...]) -> list[int]:
    return [axis for axis, d in enumerate(factor_shape) if d > 1]


def _strategy(weight: Var, factor_shape: tuple[int, ...], before_op: Operation) -> str:
    """How :func:`scale_compressed` folds (``"shift_scale"``, ``"lut"``, ``"affine"``, ``"append"``) or,
    starting with ``"refuse:"``, why it cannot."""
    op = weight.op
    kind = op.op_type
    axes = _varying_axes(factor_shape)
    if weight.dtype not in (types.fp16, types.fp32):
        return f"refuse:weight compressed by {kind} is not floating-point: cannot fold a per-channel scale"
    if kind == "constexpr_blockwise_shift_scale" and op.scale.val is not None:
        if op.offset is None or op.offset.val is not None:
            return "shift_scale"
    if kind == "constexpr_lut_to_dense" and "shape" not in op.inputs and op.lut.val is not None:
        lut = op.lut.val
        if lut.dtype.kind == "f" and all(lut.shape[a] == weight.shape[a] for a in axes):
            return "lut"
    if kind == "constexpr_affine_dequantize" and len(axes) <= 1:
        scale = np.asarray(op.scale.val)
        if not axes or scale.ndim == 0 or int(op.axis.val) % weight.rank == axes[0]:
            return "affine"
    if _opset(before_op) < _IOS18:
        return (
            f"refuse:weight compressed by {kind}: cannot fold a per-channel scale into it; "
            "needs iOS18 or later (constexpr_blockwise_shift_scale)"
        )
    return "append"


def scale_refusal(weight: Var, factor_shape: tuple[int, ...], before_op: Operation) -> str | None:
    """Why a factor of shape ``factor_shape`` cannot fold into the compressed ``weight``, or None.

    Args:
        weight: A compressed weight (:func:`is_compressed`).
        factor_shape: The factor's shape: the weight's rank, each axis 1 or the weight's size.
        before_op: The op the new ops go before (its function's opset decides what is available).

    Returns:
        None when :func:`scale_compressed` can fold, else the reason (for ``var_constraints``).
    """
    strategy = _strategy(weight, factor_shape, before_op)
    return strategy[len("refuse:") :] if strategy.startswith("refuse:") else None


def _expand(array: np.ndarray, factor_shape: tuple[int, ...], data_shape: tuple[int, ...]) -> np.ndarray:
    """A blockwise ``scale`` / ``offset`` repeated to one entry per element along the axes the factor
    varies on."""
    for axis in _varying_axes(factor_shape):
        array = np.repeat(array, data_shape[axis] // array.shape[axis], axis=axis)
    return array


def scale_compressed(weight: Var, factor: np.ndarray, before_op: Operation) -> Var:
    """The compressed ``weight`` times ``factor``, built from new ``constexpr_*`` ops before ``before_op``.

    Args:
        weight: A compressed weight for which :func:`scale_refusal` gives None.
        factor: The factor, of the weight's rank, each axis 1 or the weight's size.
        before_op: The op the new ops go before.

    Returns:
        The new compressed weight (same shape and dtype as ``weight``).
    """
    op = weight.op
    factor = np.asarray(factor, dtype=np.float64)
    strategy = _strategy(weight, factor.shape, before_op)
    if strategy == "shift_scale":
        scale = op.scale.val
        data_shape = tuple(weight.shape)
        new_scale = (_expand(scale, factor.shape, data_shape) * factor).astype(scale.dtype)
        kwargs = {"data": op.data, "scale": new_scale}
        if op.offset is not None:
            kwargs["offset"] = _expand(op.offset.val, factor.shape, data_shape)
        return mb.constexpr_blockwise_shift_scale(**kwargs, before_op=before_op)
    if strategy == "lut":
        lut = op.lut.val
        new_lut = (lut * factor.reshape(factor.shape + (1, 1))).astype(lut.dtype)
        kwargs = {"indices": op.indices, "lut": new_lut}
        if op.vector_axis is not None:
            kwargs["vector_axis"] = op.vector_axis
        return mb.constexpr_lut_to_dense(**kwargs, before_op=before_op)
    if strategy == "affine":
        axes = _varying_axes(factor.shape)
        axis = axes[0] if axes else int(op.axis.val) % weight.rank
        size = weight.shape[axis]
        scale, zero_point = np.asarray(op.scale.val), np.asarray(op.zero_point.val)
        per_axis = factor.reshape(-1) if axes else np.full(size, factor.reshape(-1)[0])
        new_scale = (np.broadcast_to(scale, (size,)) * per_axis).astype(scale.dtype)
        return mb.constexpr_affine_dequantize(
            quantized_data=op.quantized_data,
            zero_point=np.broadcast_to(zero_point, (size,)).copy(),
            scale=new_scale,
            axis=axis,
            before_op=before_op,
        )
    if strategy == "append":
        dtype = np.float16 if weight.dtype == types.fp16 else np.float32
        return mb.constexpr_blockwise_shift_scale(
            data=weight, scale=factor.astype(dtype), before_op=before_op
        )
    raise ValueError(f"scale_compressed on {weight.name}: {strategy[len('refuse:') :]}")
