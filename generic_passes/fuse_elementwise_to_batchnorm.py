"""``common::fuse_elementwise_to_batchnorm``: a per-channel ``mul`` then ``add`` into one ``batch_norm``.

Math: ``batch_norm(x, mean=0, variance=1, gamma, beta, eps)[n, c, h, w] = gamma[c] * x[n, c, h, w] /
sqrt(1 + eps) + beta[c]``, which is ``x * gamma + beta`` up to the factor ``1 / sqrt(1 + eps)``. Like
coremltools' pass, ours keeps ``batch_norm``'s default ``eps = 1e-5``, a relative change of
``1 - 1/sqrt(1 + 1e-5) ~= 5.0e-6`` on the scaled term (so the programs stay identical to coremltools').

Operand order of ``mul`` and ``add`` never matters (the matcher tries both)::

                 const gamma   const beta
                      |            |
                      v            v
        x (rank 4) --> mul ------> add --> y

    with gamma, beta of shape (1, C, 1, 1) or (C, 1, 1), becomes:

        x --> batch_norm(mean=zeros(C), variance=ones(C), gamma=squeeze(gamma), beta=squeeze(beta)) --> y

The ``batch_norm`` is inserted before the ``mul`` and takes the name of the ``add``'s output, as in
coremltools. Beyond coremltools, one of gamma / beta may be a size-1 constant (a scalar, ``(1,1,1,1)``,
...): it is repeated to ``C`` channels, ``C`` taken from the other constant. Refused where coremltools'
fusion is wrong: ``x`` has one channel that the constants broadcast to ``C`` (the output shape would
change), or gamma and beta have different channel counts; where a constant has a single element
coremltools emits a rank-0 ``beta`` (or refuses), ours a ``[C]`` one as ``batch_norm`` specifies.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var, get_new_symbol, types
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from pattern_infra import Pattern, register_generic_pass

__all__ = ["elementwise_to_batchnorm", "transform_elementwise_to_batchnorm"]

_RANK4 = [get_new_symbol(), get_new_symbol(), get_new_symbol(), get_new_symbol()]


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def elementwise_to_batchnorm(x):
    mul = mb.mul(x=x, y=np.ones((1, 2, 1, 1), np.float32), name="mul")
    return mb.add(x=mul, y=np.zeros((1, 2, 1, 1), np.float32), name="add")


def _channels(value: np.ndarray) -> int | None:
    """C for a (1, C, 1, 1) or (C, 1, 1) array, 1 for a single element, None for anything else."""
    if value.size == 1 and value.ndim <= 4:
        return 1
    if value.ndim in (3, 4) and value.shape == (1,) * (value.ndim - 3) + (value.shape[-3], 1, 1):
        return int(value.shape[-3])
    return None


def _constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    x: Var = pattern.root_var
    if x.val is not None:
        return False, "x is a constant (const_elimination's job)"
    if x.rank != 4 or x.dtype not in (types.fp16, types.fp32):
        return False, f"x of rank {x.rank} or not fp16/fp32 (batch_norm wants rank 4)"
    gamma = np.asarray(pattern.operand("mul", "y").val)
    beta = np.asarray(pattern.operand("add", "y").val)
    c_gamma, c_beta = _channels(gamma), _channels(beta)
    if c_gamma is None or c_beta is None:
        return False, "the scale or the shift is not per channel (shape (1, C, 1, 1))"
    channels = max(c_gamma, c_beta)
    if channels == 1 or min(c_gamma, c_beta) not in (1, channels):
        return False, f"one channel, or different channel counts ({c_gamma}, {c_beta})"  # as coremltools
    c_x = x.shape[1]
    if not is_symbolic(c_x) and int(c_x) != channels:
        return False, f"x has {c_x} channels, the constants {channels}"  # batch_norm would keep one
    pattern.add_attribute("channels", channels)
    return True


def _per_channel(value: np.ndarray, channels: int, dtype: type) -> np.ndarray:
    squeezed = np.squeeze(value)
    if squeezed.shape == (channels,):
        return squeezed  # coremltools' np.squeeze, dtype untouched
    return np.full((channels,), squeezed.reshape(()), dtype=dtype)


def transform_elementwise_to_batchnorm(pattern: Pattern) -> None:
    """Inserts the ``batch_norm`` before the ``mul`` and redirects the ``add``'s output to it."""
    x: Var = pattern.root_var
    channels: int = pattern.channels
    dtype = types.nptype_from_builtin(x.dtype)
    gamma = np.asarray(pattern.operand("mul", "y").val)
    beta = np.asarray(pattern.operand("add", "y").val)
    bn = mb.batch_norm(
        x=x,
        mean=np.zeros((channels,), dtype),
        variance=np.ones((channels,), dtype),
        gamma=_per_channel(gamma, channels, dtype),
        beta=_per_channel(beta, channels, dtype),
        name=pattern.add.outputs[0].name,
        before_op=pattern.mul,
    )
    pattern.replace_output(bn)


register_generic_pass(
    ops_arrangement=elementwise_to_batchnorm,
    var_constraints=_constraints,
    transform_pattern=transform_elementwise_to_batchnorm,
    pass_name="fuse_elementwise_to_batchnorm",
    namespace="common",
    constants="const",
    name="elementwise_to_batchnorm",
)
