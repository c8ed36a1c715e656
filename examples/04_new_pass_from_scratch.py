"""A fusion nobody ships, written from scratch: hard-swish.

PyTorch's ``hardswish(x) = x * relu6(x + 3) / 6`` converts to four MIL ops, with the division by 6
written as a ``real_div`` or as a ``mul`` by 1/6. Since ``relu6(x + 3) / 6 = clip(x / 6 + 0.5, 0, 1)``,
which is MIL's ``sigmoid_hard(x, alpha=1/6, beta=0.5)``::

    x --> add(3) --> relu6 --> mul --> real_div(6) | mul(1/6) --> y
    |                           ^
    |---------------------------|

    becomes:

    x --> sigmoid_hard(alpha=1/6, beta=0.5) --> mul --> y
    |                                            ^
    |--------------------------------------------|

The two ways of dividing by 6 are two patterns in one registration; the constants are checked in
``var_constraints`` with ``pattern_infra.predicates`` (operands read as the pattern wrote them, whatever
order the program used).

Shown: a program with both writings (operands swapped in one) before and after, then the rewritten
program evaluated and compared with the formula in numpy.
"""

import _common as ex
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import predicates as P
from pattern_infra import register_generic_pass
from pattern_infra.verification.evaluator import evaluate

SPEC = [mb.TensorSpec(shape=(get_new_symbol(),))]


@mb.program(input_specs=SPEC)
def hard_swish_div(x):
    gate = mb.relu6(x=mb.add(x=x, y=3.0, name="add3"), name="relu6")
    return mb.real_div(x=mb.mul(x=x, y=gate, name="mul_x"), y=6.0, name="scale")


@mb.program(input_specs=SPEC)
def hard_swish_mul(x):
    gate = mb.relu6(x=mb.add(x=x, y=3.0, name="add3"), name="relu6")
    return mb.mul(x=mb.mul(x=x, y=gate, name="mul_x"), y=1 / 6, name="scale")


def var_constraints(pattern):
    divisor = 6.0 if pattern.scale.op_type == "real_div" else 1 / 6
    return (
        P.dtype_is(pattern.root_var, "fp16", "fp32")
        and P.scalar_close_to(pattern.operand("add3", "y"), 3.0)
        and P.scalar_close_to(pattern.operand("scale", "y"), divisor)
    )


def transform_pattern(pattern):
    x, last = pattern.root_var, pattern.scale
    gate = mb.sigmoid_hard(x=x, alpha=1 / 6, beta=0.5, before_op=last)
    pattern.replace_output(mb.mul(x=x, y=gate, name=last.outputs[0].name, before_op=last))


hard_swish_pass = register_generic_pass(
    [hard_swish_div, hard_swish_mul],
    var_constraints,
    transform_pattern,
    "fuse_hard_swish",
    "examples",
    name="hard_swish",
)


@mb.program(input_specs=[mb.TensorSpec(shape=(64,))])
def prog(x):
    a = mb.real_div(x=mb.mul(x=x, y=mb.relu6(x=mb.add(x=x, y=3.0))), y=6.0, name="as_div")
    b = mb.mul(x=1 / 6, y=mb.mul(x=mb.relu6(x=mb.add(x=3.0, y=a)), y=a), name="as_mul_swapped")
    return mb.real_div(x=mb.mul(x=b, y=mb.relu6(x=mb.add(x=b, y=2.0))), y=6.0, name="plus_2_not_3")


ex.banner("hard-swish written with real_div, then with mul(1/6) and swapped operands; then x + 2")
after = ex.rewrite(hard_swish_pass, prog)
ex.check(ex.op_types(after)[:4] == ["sigmoid_hard", "mul"] * 2, "both hard-swishes fused, the x + 2 one kept")

ex.banner("numerical check against the formula x * relu6(x + 3) / 6")
x = np.linspace(-5.0, 5.0, 64)  # covers both clip points, -3 and 3


def hard_swish(v):
    return v * np.clip(v + 3.0, 0.0, 6.0) / 6.0


expected = hard_swish(hard_swish(x))
expected = expected * np.clip(expected + 2.0, 0.0, 6.0) / 6.0
(got,) = evaluate(after, {"x": x}).values()
err = float(np.max(np.abs(got - expected)))
ex.check(
    np.allclose(got, expected, rtol=1e-6, atol=1e-7),
    f"rewritten program = formula, up to its fp32 constants (max |diff| {err:.1e})",
)
