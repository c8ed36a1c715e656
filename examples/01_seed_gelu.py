"""The design document's GELU example, written once.

The design document registers two patterns for the tanh-approximated GELU (0.5 multiplied with the tanh
term, or with ``x`` first) and a ``var_constraints`` that checks every constant on *both* operands of
each ``mul`` and ``add``, because the seed matcher only knew one operand order. Here:

* the two association orders are one registration (a list of patterns, one sub-pass each);
* operand order is the matcher's business (``mul`` and ``add`` are commutative), so the program below
  writes them the other way round and still fuses;
* ``constants="value"`` makes every pattern constant a value to match (rtol 1e-5), which replaces the
  seed's ``var_constraints``.

Shown: the program before and after (four GELUs, each a different writing), and numerical equality.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb

from pattern_infra import register_generic_pass

SPEC = [mb.TensorSpec(shape=(1, 1024, 4096))]  # shapes in a pattern are irrelevant: it matches any


@mb.program(input_specs=SPEC)
def gelu_to_detect_1(x):
    # y = x * (0.5 * (tanh(((.0447)x^3 + x ) * sqrt(2/pi)) + 1))
    pow = mb.pow(x=x, y=3.0, name="pow")
    mul_1 = mb.mul(x=0.044714998453855515, y=pow, name="mul_1")
    add = mb.add(x=x, y=mul_1, name="add")
    mul_2 = mb.mul(x=0.7978845834732056, y=add, name="mul_2")
    tanh = mb.tanh(x=mul_2, name="tanh")
    add_1 = mb.add(x=1.0, y=tanh, name="add_1")
    mul = mb.mul(x=0.5, y=add_1, name="mul")
    mul_3 = mb.mul(x=mul, y=x, name="mul_3")
    return mul_3


@mb.program(input_specs=SPEC)
def gelu_to_detect_2(x):
    # y = (0.5 * x) * (tanh(((.0447)x^3 + x ) * sqrt(2/pi)) + 1)
    pow = mb.pow(x=x, y=3.0, name="pow")
    mul_1 = mb.mul(x=0.044714998453855515, y=pow, name="mul_1")
    add = mb.add(x=x, y=mul_1, name="add")
    mul_2 = mb.mul(x=0.7978845834732056, y=add, name="mul_2")
    tanh = mb.tanh(x=mul_2, name="tanh")
    add_1 = mb.add(x=1.0, y=tanh, name="add_1")
    mul = mb.mul(x=0.5, y=x, name="mul")
    mul_3 = mb.mul(x=mul, y=add_1, name="mul_3")
    return mul_3


def transform_pattern(pattern):
    out_name = pattern.mul_3.outputs[0].name
    gelu = mb.gelu(x=pattern.root_var, mode="TANH_APPROXIMATION", name=out_name, before_op=pattern.mul_3)
    pattern.replace_output(gelu)  # the framework removes the ops this left unused


gelu_pass = register_generic_pass(
    [gelu_to_detect_1, gelu_to_detect_2],
    None,
    transform_pattern,
    "fuse_gelu_tanh_approximation",
    "examples",
    constants="value",
    name="gelu_tanh",
)


def gelu_tanh(x, half_first, swapped):
    """One GELU as a converter might write it; ``swapped`` flips every mul/add operand order."""

    def mul(a, b):
        return mb.mul(x=b, y=a) if swapped else mb.mul(x=a, y=b)

    def add(a, b):
        return mb.add(x=b, y=a) if swapped else mb.add(x=a, y=b)

    inner = mul(0.7978845834732056, add(x, mul(0.044715, mb.pow(x=x, y=3.0))))
    tanh_plus_1 = add(1.0, mb.tanh(x=inner))
    if half_first:
        return mul(mul(0.5, x), tanh_plus_1)
    return mul(mul(0.5, tanh_plus_1), x)


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 8))])
def prog(x):
    for half_first in (False, True):
        for swapped in (False, True):
            x = mb.relu(x=gelu_tanh(x, half_first, swapped))
    return x


ex.banner("one registration, two sub-passes")
print(f"{gelu_pass.pass_id}: sub-passes {gelu_pass.order}")
ex.banner("program with both association orders, operands as written and swapped")
after = ex.rewrite(gelu_pass, prog)
print("rewrites per sub-pass:", {sub.name: sub.stats.rewrites for sub in gelu_pass.passes})
ex.check(ex.op_types(after) == ["gelu", "relu"] * 4, "all four GELUs fused")
ex.compare(prog, after)
