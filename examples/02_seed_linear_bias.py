"""The design document's linear-bias example: four rewrites, one registration.

``linear(x, W, b) = x @ W.T + b``, so a constant ``c`` (one value per output feature) added to or
subtracted from a linear goes into its bias::

    linear + c  ->  linear(W, b + c)        c + linear  ->  linear(W, b + c)
    linear - c  ->  linear(W, b - c)        c - linear  ->  linear(-W, c - b)

The design document needed two patterns (``add``, ``sub``) and helper functions to find which operand
is the linear. Here ``alternatives`` lets the op named ``add_or_sub`` be an ``add`` or a ``sub``, the
matcher tries both operand orders (the pattern writes an ``add``, which is commutative), and the
transform reads the program's real operand order, which decides the math for ``sub``.

Shown: the program before and after; then, for a random input, each fused output computed by hand in
numpy from the new constants (``x @ W'.T + b'``) against the formula on the original constants.
"""

import _common as ex
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import register_generic_pass

D_IN, D_OUT = 3, 4


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), D_IN))])
def linear_bias(x):
    zeros = np.zeros(D_OUT, np.float32)
    linear = mb.linear(x=x, weight=np.zeros((D_OUT, D_IN), np.float32), bias=zeros, name="linear")
    return mb.add(x=linear, y=zeros, name="add_or_sub")


def var_constraints(pattern):
    c = pattern.operand("add_or_sub", "y")  # the operand the pattern calls y: never the linear
    d_out = pattern.linear.bias.shape[0]
    # one value per output feature, and no broadcast raising the rank of the result
    out_rank = pattern.linear.outputs[0].rank
    return c.shape[-1:] == (d_out,) and np.prod(c.shape) == d_out and c.rank <= out_rank


def transform_pattern(pattern):
    linear, add_or_sub = pattern.linear, pattern.add_or_sub
    weight, bias = linear.weight.val, linear.bias.val
    c = pattern.operand("add_or_sub", "y").val.reshape(-1)
    if add_or_sub.op_type == "add":
        bias = bias + c
    elif add_or_sub.x is linear.outputs[0]:  # linear - c
        bias = bias - c
    else:  # c - linear
        weight, bias = -weight, c - bias
    fused = mb.linear(x=linear.x, weight=weight, bias=bias, name=add_or_sub.outputs[0].name, before_op=linear)
    pattern.replace_output(fused)


linear_bias_pass = register_generic_pass(
    linear_bias,
    var_constraints,
    transform_pattern,
    "fuse_linear_bias",
    "examples",
    alternatives={"add_or_sub": ["add", "sub"]},
    # add is commutative by itself; naming the op asks for both orders of sub too (c - linear), and the
    # transform reads which side the linear is on
    commutative=["add_or_sub"],
    const_rules={"linear.weight": "const", "linear.bias": "const", "add_or_sub.y": "const"},
)

CASES = {  # output name: (op, constant written first?, the same in numpy)
    "lin_plus_c": (mb.add, False, lambda lin, c: lin + c),
    "c_plus_lin": (mb.add, True, lambda lin, c: c + lin),
    "lin_minus_c": (mb.sub, False, lambda lin, c: lin - c),
    "c_minus_lin": (mb.sub, True, lambda lin, c: c - lin),
}
rng = np.random.default_rng(0)
W = rng.standard_normal((len(CASES), D_OUT, D_IN)).astype(np.float32)
B = rng.standard_normal((len(CASES), D_OUT)).astype(np.float32)
C = rng.standard_normal((len(CASES), D_OUT)).astype(np.float32)


@mb.program(input_specs=[mb.TensorSpec(shape=(5, D_IN)), mb.TensorSpec(shape=(D_OUT,))])
def prog(x, runtime_c):
    outs = []
    for i, (name, (op, c_first, _)) in enumerate(CASES.items()):
        lin = mb.linear(x=x, weight=W[i], bias=B[i])
        outs.append(op(x=C[i], y=lin, name=name) if c_first else op(x=lin, y=C[i], name=name))
    outs.append(mb.add(x=mb.linear(x=x, weight=W[0], bias=B[0]), y=runtime_c, name="lin_plus_input"))
    return outs


ex.banner("add and sub, linear on either side; the last add's operand is a program input")
after = ex.rewrite(linear_bias_pass, prog)
ex.check(ex.op_types(after) == ["linear"] * 5 + ["add"], "four fused, the runtime operand left alone")

ex.banner("x @ W'.T + b' by hand (new constants) against the formula on the original constants")
x = rng.standard_normal((5, D_IN))
fused = {op.outputs[0].name: op for op in after.functions["main"].operations if op.op_type == "linear"}
for i, (name, (_, _, formula)) in enumerate(CASES.items()):
    expected = formula(x @ W[i].T.astype(np.float64) + B[i], C[i])
    got = x @ fused[name].weight.val.T.astype(np.float64) + fused[name].bias.val
    err = float(np.max(np.abs(got - expected)))
    ex.check(np.allclose(got, expected, rtol=1e-6, atol=1e-6), f"{name:<12} agrees (max |diff| {err:.1e})")
