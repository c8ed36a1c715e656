"""``common::fuse_reduce_mean``: ``reduce_sum`` scaled by ``1/N`` into one ``reduce_mean``.

Math: over axes ``A`` of ``x`` with ``N = prod(x.shape[a] for a in A)``,
``reduce_mean(x, A) = reduce_sum(x, A) * (1/N) = reduce_sum(x, A) / N``::

    Pattern 1:                               const 1/N (one element)
                                                 |
                                                 v
        x --> reduce_sum(axes, keep_dims) --> mul --> y

    Pattern 2:                               const N (one element)
                                                 |
                                                 v
        x --> reduce_sum(axes, keep_dims) --> real_div --> y        (the sum is the dividend)

    Both become:

        x --> reduce_mean(axes, keep_dims) --> y

As in coremltools: the reduced dimensions must be known at compile time, the constant must be within
``1e-6`` of ``1/N`` (``mul``) or ``1e-2`` of ``N`` (``real_div``), and the ``reduce_mean`` is inserted
before the ``mul``/``real_div``, named after its output, with the ``reduce_sum``'s ``axes`` and
``keep_dims``. Stricter than coremltools where its tolerance would change the result: the constant must
also be within a relative ``1e-3`` of ``1/N`` (resp. ``N``; wide enough for an fp16 ``1/N``, while
coremltools' absolute ``1e-6`` accepts a 1% error once ``N`` reaches 10000), and a one-element constant
of higher rank than the sum (which broadcasts the output to another shape) is refused.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var, get_new_symbol
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = ["reduce_sum_mul", "reduce_sum_real_div", "transform_reduce_mean"]

_RANK3 = [get_new_symbol(), get_new_symbol(), get_new_symbol()]
_RELATIVE = 1e-3


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK3)])
def reduce_sum_mul(x):
    total = mb.reduce_sum(x=x, axes=[-1], keep_dims=False, name="reduce_sum")
    return mb.mul(x=total, y=np.float32(0.5), name="scale")


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK3)])
def reduce_sum_real_div(x):
    total = mb.reduce_sum(x=x, axes=[-1], keep_dims=False, name="reduce_sum")
    return mb.real_div(x=total, y=np.float32(2.0), name="scale")


def _count(x: Var, axes: np.ndarray) -> int | None:
    if x.shape is None:
        return None
    count = 1
    for axis in np.atleast_1d(axes):
        dim = x.shape[int(axis)]
        if is_symbolic(dim):
            return None
        count *= int(dim)
    return count


def _constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    reduce_sum, scale = pattern.reduce_sum, pattern.scale
    if reduce_sum.axes.val is None or reduce_sum.keep_dims.val is None:
        return False, "the sum's axes or keep_dims is not a constant"
    count = _count(pattern.root_var, reduce_sum.axes.val)
    if count is None or count == 0:
        return False, "the number of elements summed is not known"
    const = pattern.operand("scale", "y")
    value = np.asarray(const.val)
    if value.size != 1 or value.ndim > reduce_sum.outputs[0].rank:
        return False, "the scale is not a one-element constant of the sum's rank at most"
    scalar = float(value.reshape(()))
    # coremltools' absolute 1e-6, or the constant's own rounding (a float16 1/N of a saved model)
    absolute = max(1e-6, predicates.dtype_rtol(const) / count)
    if scale.op_type == "mul":
        if abs(scalar - 1.0 / count) < absolute and abs(scalar * count - 1.0) <= _RELATIVE:
            return True
        return False, f"the scale {scalar:.9g} is not 1/{count}"
    if abs(scalar - count) < 1e-2 and abs(scalar / count - 1.0) <= _RELATIVE:
        return True
    return False, f"the divisor {scalar:.9g} is not {count}"


def transform_reduce_mean(pattern: Pattern) -> None:
    """Inserts ``reduce_mean`` before the scaling op and redirects its output."""
    reduce_sum, scale = pattern.reduce_sum, pattern.scale
    mean = mb.reduce_mean(
        x=pattern.root_var,
        axes=reduce_sum.axes.val,
        keep_dims=reduce_sum.keep_dims.val,
        name=scale.outputs[0].name,
        before_op=scale,
    )
    pattern.replace_output(mean)


register_generic_pass(
    ops_arrangement=[reduce_sum_mul, reduce_sum_real_div],
    var_constraints=_constraints,
    transform_pattern=transform_reduce_mean,
    pass_name="fuse_reduce_mean",
    namespace="common",
    constants="const",
    name="reduce_mean",
)
