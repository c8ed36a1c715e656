"""Alternatives: several op types at one pattern op, and several sub-patterns in one registration.

1. **Op alternatives** (TFLite's ``Op(['Reshape', 'Squeeze'])``): ``alternatives={"reduce": [...]}``
   lets the pattern op named ``reduce`` be any of the listed types (they must share the operand names
   the pattern uses); the transform reads ``pattern.reduce.op_type``. Here a reduction that keeps its
   axis, then squeezes it away, becomes the same reduction with ``keep_dims=False``::

       x --> reduce_mean | reduce_sum | reduce_max (axes=A, keep_dims=True) --> squeeze(axes=A) --> y
       becomes   x --> <same reduction>(axes=A, keep_dims=False) --> y

2. **Alternative sub-patterns** (TFLite's ``OneOf``): a list of pattern programs sharing the callbacks,
   one sub-pass each. Here a clamp written in either nesting becomes a ``clip``::

       x --> maximum(lo) --> minimum(hi) --> y      or      x --> minimum(hi) --> maximum(lo) --> y
       becomes   x --> clip(alpha=lo, beta=hi) --> y        (when lo <= hi)

Shown: each program before and after, and numerical equality.
"""

import _common as ex
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import predicates as P
from pattern_infra import register_generic_pass

ANY_2D = [mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))]

# -- 1. op alternatives -------------------------------------------------------------------------------


@mb.program(input_specs=ANY_2D)
def reduce_then_squeeze(x):
    reduced = mb.reduce_mean(x=x, axes=[-1], keep_dims=True, name="reduce")
    return mb.squeeze(x=reduced, axes=[-1], name="squeeze")


def same_axes(pattern):
    rank = pattern.root_var.rank
    axes = [int(a) % rank for a in np.atleast_1d(pattern.reduce.axes.val)]
    return bool(pattern.reduce.keep_dims.val) and P.axes_are(pattern.squeeze.axes, rank, axes)


def reduce_without_keep_dims(pattern):
    reduce_op = getattr(mb, pattern.reduce.op_type)  # whichever alternative matched
    out = reduce_op(
        x=pattern.root_var,
        axes=pattern.reduce.axes.val,
        keep_dims=False,
        name=pattern.squeeze.outputs[0].name,
        before_op=pattern.squeeze,
    )
    pattern.replace_output(out)


squeeze_pass = register_generic_pass(
    reduce_then_squeeze,
    same_axes,
    reduce_without_keep_dims,
    "fold_squeeze_into_reduce",
    "examples",
    const_rules={"reduce.axes": "const", "squeeze.axes": "const"},
    alternatives={"reduce": ["reduce_mean", "reduce_sum", "reduce_max"]},
)


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 4))])
def reductions(x):
    def reduce_squeeze(op, axis, name):
        return mb.squeeze(x=op(x=x, axes=[axis], keep_dims=True), axes=[axis], name=name)

    return (
        reduce_squeeze(mb.reduce_mean, 2, "mean"),
        reduce_squeeze(mb.reduce_sum, 1, "sum"),
        reduce_squeeze(mb.reduce_max, -3, "max"),
        reduce_squeeze(mb.reduce_min, 2, "min_not_listed"),
    )


ex.banner("1. alternatives={'reduce': ['reduce_mean', 'reduce_sum', 'reduce_max']}")
after = ex.rewrite(squeeze_pass, reductions)
ex.check(
    ex.op_types(after) == ["reduce_mean", "reduce_sum", "reduce_max", "reduce_min", "squeeze"],
    "the three listed reductions fused, reduce_min left alone",
)
ex.compare(reductions, after)

# -- 2. alternative sub-patterns -----------------------------------------------------------------------


@mb.program(input_specs=ANY_2D)
def max_then_min(x):
    return mb.minimum(x=mb.maximum(x=x, y=0.0, name="lower"), y=1.0, name="upper")


@mb.program(input_specs=ANY_2D)
def min_then_max(x):
    return mb.maximum(x=mb.minimum(x=x, y=1.0, name="upper"), y=0.0, name="lower")


def bounds(pattern):
    return float(pattern.operand("lower", "y").val), float(pattern.operand("upper", "y").val)


def ordered_scalar_bounds(pattern):
    lo, hi = pattern.operand("lower", "y"), pattern.operand("upper", "y")
    return np.size(lo.val) == 1 and np.size(hi.val) == 1 and bounds(pattern)[0] <= bounds(pattern)[1]


def to_clip(pattern):
    lo, hi = bounds(pattern)
    last = pattern.final_op  # ``upper`` in the first pattern, ``lower`` in the second
    pattern.replace_output(
        mb.clip(x=pattern.root_var, alpha=lo, beta=hi, name=last.outputs[0].name, before_op=last)
    )


# constants="const": the bounds must be compile-time constants. (With the default "any", a program
# constant written first, as in minimum(0.5, a), could be bound to the pattern's input x instead.)
clamp_pass = register_generic_pass(
    [max_then_min, min_then_max],
    ordered_scalar_bounds,
    to_clip,
    "fuse_clamp",
    "examples",
    name="clamp",
    constants="const",
)


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 6))])
def clamps(x):
    a = mb.minimum(x=mb.maximum(x=x, y=-1.0), y=1.0, name="max_min")
    b = mb.maximum(x=-0.5, y=mb.minimum(x=0.5, y=a), name="min_max_swapped")
    return mb.minimum(x=mb.maximum(x=b, y=2.0), y=1.0, name="empty_range")


ex.banner("2. two sub-patterns, one registration")
print(f"{clamp_pass.pass_id}: sub-passes {clamp_pass.order}")
after = ex.rewrite(clamp_pass, clamps)
ex.check(
    ex.op_types(after) == ["clip", "clip", "maximum", "minimum"], "both nestings fused, lo > hi left alone"
)
ex.compare(clamps, after)
