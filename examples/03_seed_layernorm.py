"""The design document's layernorm example, as a correct ``layer_norm`` fusion over the last axis.

The user writes the sequence a converter produces for ``gamma * (x - mean) / sqrt(var + eps) + beta``
(the pattern of the design document, with its op names)::

    mean  = reduce_op(x)                        reduce_mean over the last axis, keep_dims=True
    diff  = sub_op1(x, mean)
    var   = reduce_op2(square_op(diff))         same reduction
    scale = mul_op1(rsqrt_op(add_op1(var, eps)), gamma)
    y     = end_op(mul_op2(x, scale), sub_op2(beta, mul_op3(mean, scale)))

    becomes:

    y = layer_norm(x, axes=[-1], gamma, beta, epsilon=eps + rsqrt_op's own epsilon)

What the design document's ``var_constraints`` checked by hand (intermediates used only inside the
match, not block outputs) the matcher guarantees; what is left is the math: both reductions over the
last axis only with ``keep_dims``, a scalar constant ``eps``, and constants ``gamma`` and ``beta`` with
one value per feature (or one for all). ``rsqrt`` adds an
``epsilon`` of its own (1e-12 by default): the fused epsilon is the sum.

Shown: a program with a norm over the last axis (fused) and one over axis 1 (left alone), before and
after, and numerical equality.
"""

import _common as ex
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import predicates as P
from pattern_infra import register_generic_pass

D = 8


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol(), D))])
def layernorm(x):
    gamma, beta = np.ones(D, np.float32), np.zeros(D, np.float32)
    mean = mb.reduce_mean(x=x, axes=[-1], keep_dims=True, name="reduce_op")
    diff = mb.sub(x=x, y=mean, name="sub_op1")
    square = mb.square(x=diff, name="square_op")
    var = mb.reduce_mean(x=square, axes=[-1], keep_dims=True, name="reduce_op2")
    rsqrt = mb.rsqrt(x=mb.add(x=var, y=1e-5, name="add_op1"), name="rsqrt_op")
    scale = mb.mul(x=rsqrt, y=gamma, name="mul_op1")
    x_scaled = mb.mul(x=x, y=scale, name="mul_op2")
    shift = mb.sub(x=beta, y=mb.mul(x=mean, y=scale, name="mul_op3"), name="sub_op2")
    return mb.add(x=x_scaled, y=shift, name="end_op")


def _per_feature(var, d, rank):
    """A constant with one value per feature along the last axis, or one value for all."""
    size = np.size(var.val) if P.is_constant(var) else 0
    return var.rank <= rank and (size == 1 or (size == d and var.shape[-1] == d))


def var_constraints(pattern):
    x, eps = pattern.root_var, pattern.operand("add_op1", "y")
    if not x.rank or not isinstance(x.shape[-1], int):
        return False  # the number of features must be known
    rank, d = x.rank, x.shape[-1]
    reductions = (pattern.reduce_op, pattern.reduce_op2)
    return (
        all(P.axes_are(op.axes, rank, [-1]) and op.keep_dims.val for op in reductions)
        and P.is_constant(eps)
        and np.size(eps.val) == 1
        and _per_feature(pattern.operand("mul_op1", "y"), d, rank)  # gamma
        and _per_feature(pattern.operand("sub_op2", "x"), d, rank)  # beta
    )


def _vector(var, d):
    return np.array(np.broadcast_to(np.ravel(var.val), (d,)))  # (d,), (1, ..., d) or one value -> (d,)


def transform_pattern(pattern):
    d = pattern.root_var.shape[-1]
    layer_norm = mb.layer_norm(
        x=pattern.root_var,
        axes=[-1],
        gamma=_vector(pattern.operand("mul_op1", "y"), d),
        beta=_vector(pattern.operand("sub_op2", "x"), d),
        epsilon=float(pattern.operand("add_op1", "y").val) + float(pattern.rsqrt_op.epsilon.val),
        name=pattern.end_op.outputs[0].name,
        before_op=pattern.end_op,
    )
    pattern.replace_output(layer_norm)


layernorm_pass = register_generic_pass(
    layernorm, var_constraints, transform_pattern, "layernorm_pass", "examples"
)


def written_out_norm(x, axis, gamma, beta, eps=1e-5):
    """The sequence as a converter writes it, with some operands the other way round."""
    mean = mb.reduce_mean(x=x, axes=[axis], keep_dims=True)
    diff = mb.sub(x=x, y=mean)
    var = mb.reduce_mean(x=mb.square(x=diff), axes=[axis], keep_dims=True)
    scale = mb.mul(x=gamma, y=mb.rsqrt(x=mb.add(x=eps, y=var)))
    return mb.add(x=mb.sub(x=beta, y=mb.mul(x=scale, y=mean)), y=mb.mul(x=scale, y=x))


rng = np.random.default_rng(0)


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, D))])
def prog(x):
    gamma = rng.standard_normal((1, 1, D)).astype(np.float32)
    beta = rng.standard_normal(D).astype(np.float32)
    last = written_out_norm(x, -1, gamma, beta)
    return written_out_norm(last, 1, rng.standard_normal((3, 1)).astype(np.float32), np.float32(0.5))


ex.banner("layer norm over the last axis (fused), then over axis 1 (not a layer_norm over [-1])")
after = ex.rewrite(layernorm_pass, prog)
ex.check(
    ex.op_types(after)[0] == "layer_norm" and len(ex.op_types(after)) == 12,
    "the norm over the last axis fused, the other left",
)
ex.compare(prog, after)
