"""Patterns with several inputs (``root_vars``) and several outputs (``final_ops``).

A pattern is any connected DAG in one ``mb.program``: every function input is a root, every returned
value an output. Two rewrites of an attention layer show both:

1. **Several outputs**: the q, k and v projections of one input, three ``linear`` ops returned by the
   pattern (``pattern.final_ops``), become one ``linear`` with the weights stacked and a ``split``; the
   transform replaces each output with ``pattern.replace_output(new, old_var=...)``::

       x --> linear(Wq) --> q          becomes    x --> linear([Wq; Wk; Wv]) --> split --> q, k, v
       x --> linear(Wk) --> k
       x --> linear(Wv) --> v

2. **Several inputs**: ``softmax(q @ k.T * scale) @ v``, with q, k and v three pattern inputs read as
   ``pattern.root_vars``, becomes ``scaled_dot_product_attention(q, k, v)`` (iOS18 and later) when the
   scale is the op's own, ``1 / sqrt(d)``.

Shown: the program before, after the first pass and after the second, and numerical equality.
"""

import _common as ex
import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import predicates as P
from pattern_infra import register_generic_pass

D = 8


def spec(*shapes):
    return [mb.TensorSpec(shape=s) for s in shapes]


# -- 1. several outputs ------------------------------------------------------------------------------


@mb.program(input_specs=spec((get_new_symbol(), D)))
def qkv_projections(x):
    w, b = np.zeros((D, D), np.float32), np.zeros(D, np.float32)
    return (
        mb.linear(x=x, weight=w, bias=b, name="q"),
        mb.linear(x=x, weight=w, bias=b, name="k"),
        mb.linear(x=x, weight=w, bias=b, name="v"),
    )


def stack_projections(pattern):
    # The pattern's q, k, v are interchangeable, so which program linear each one matched is arbitrary:
    # stack them in program order (op_list()) and give each output its own slice.
    linears = pattern.op_list()
    fused = mb.linear(
        x=pattern.root_var,
        weight=np.concatenate([op.weight.val for op in linears]),
        bias=np.concatenate([op.bias.val for op in linears]),
        before_op=linears[0],
    )
    parts = mb.split(
        x=fused, split_sizes=[op.weight.shape[0] for op in linears], axis=-1, before_op=linears[0]
    )
    for op, part in zip(linears, parts):
        pattern.replace_output(part, old_var=op.outputs[0])


qkv_pass = register_generic_pass(
    qkv_projections, None, stack_projections, "stack_qkv", "examples", constants="const"
)

# -- 2. several inputs ---------------------------------------------------------------------------------


@mb.program(input_specs=spec((get_new_symbol(), D), (get_new_symbol(), D), (get_new_symbol(), D)))
def attention(q, k, v):
    scores = mb.matmul(x=q, y=k, transpose_y=True, name="scores")
    weights = mb.softmax(x=mb.mul(x=scores, y=1.0, name="scale"), axis=-1, name="weights")
    return mb.matmul(x=weights, y=v, name="out")


def is_sdpa(pattern):
    q, k, v = pattern.root_vars
    d = q.shape[-1]
    return (
        pattern.block.opset_version >= ct.target.iOS18  # the main block: a function, with an opset
        and not pattern.scores.transpose_x.val
        and pattern.scores.transpose_y.val
        and not pattern.out.transpose_x.val
        and not pattern.out.transpose_y.val
        and isinstance(d, int)
        and P.scalar_close_to(pattern.operand("scale", "y"), 1 / np.sqrt(d))
        and P.axes_are(pattern.weights.axis, pattern.weights.outputs[0].rank, [-1])
    )


def to_sdpa(pattern):
    q, k, v = pattern.root_vars
    out = pattern.out
    pattern.replace_output(
        mb.scaled_dot_product_attention(query=q, key=k, value=v, name=out.outputs[0].name, before_op=out)
    )


sdpa_pass = register_generic_pass(attention, is_sdpa, to_sdpa, "fuse_sdpa", "examples")

# -- the program: projections, then attention ----------------------------------------------------------

rng = np.random.default_rng(0)


@mb.program(input_specs=spec((2, 5, D)), opset_version=ct.target.iOS18)
def prog(x):
    q, k, v = (
        mb.linear(
            x=x,
            weight=rng.standard_normal((D, D)).astype(np.float32),
            bias=rng.standard_normal(D).astype(np.float32),
            name=n,
        )
        for n in "qkv"
    )
    scores = mb.mul(x=1 / np.sqrt(D), y=mb.matmul(x=q, y=k, transpose_y=True))
    return mb.matmul(x=mb.softmax(x=scores, axis=-1), y=v, name="attended")


ex.banner("1. three linears of one input (three pattern outputs) -> one linear + split")
stacked = ex.rewrite(qkv_pass, prog)
ex.check(ex.op_types(stacked)[:2] == ["linear", "split"], "q, k, v computed by one linear")
ex.compare(prog, stacked)

ex.banner("2. attention over three pattern inputs q, k, v -> scaled_dot_product_attention")
fused = ex.rewrite(sdpa_pass, stacked)
ex.check(ex.op_types(fused) == ["linear", "split", "scaled_dot_product_attention"], "attention fused")
ex.compare(prog, fused)
