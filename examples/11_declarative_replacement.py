"""Declarative replacement: ``replace_with(replacement_program, bind={...})`` writes the transform.

Instead of a ``transform_pattern`` function, give the replacement as a second ``mb.program``: its inputs
are bound to values of the match, its outputs replace the match's outputs (``pattern.output_vars()``
order). ``bind`` maps a replacement input to an operand key ``"<op>.<slot>"`` (the slot as the pattern
wrote it, whatever order the program used), a pattern input name, a constant key of
``pattern.consts``, or a callable ``f(pattern) -> Var``; inputs not listed are bound to the pattern
input of the same name. The final output keeps its name; the framework removes what became dead.

Here ``x * a + x * b`` becomes ``x * (a + b)``: ``a`` and ``b`` are bound to the operands the pattern
calls ``m1.y`` and ``m2.y``, which (constants default to "any") may be constants or computed values::

    x --> mul(a) --> add --> y          becomes       a, b --> add --> mul <-- x
    |--> mul(b) -----^                                                   |--> y

Shown: the program before and after, and numerical equality.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import register_generic_pass, replace_with

ANY = (get_new_symbol(), get_new_symbol())


@mb.program(input_specs=[mb.TensorSpec(shape=ANY)])
def two_scalings(x):
    return mb.add(x=mb.mul(x=x, y=2.0, name="m1"), y=mb.mul(x=x, y=3.0, name="m2"), name="total")


@mb.program(input_specs=[mb.TensorSpec(shape=ANY) for _ in range(3)])
def factored(x, a, b):
    return mb.mul(x=x, y=mb.add(x=a, y=b))


factor_pass = register_generic_pass(
    two_scalings,
    None,
    replace_with(factored, bind={"a": "m1.y", "b": lambda pattern: pattern.operand("m2", "y")}),
    "factor_common_input",
    "examples",
)


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3)), mb.TensorSpec(shape=(3,))])
def prog(x, s):
    y = mb.add(x=mb.mul(x=x, y=2.0), y=mb.mul(x=3.0, y=x), name="constants")
    return mb.add(x=mb.mul(x=s, y=y), y=mb.mul(x=y, y=0.5), name="input_and_constant")


ex.banner("x * a + x * b -> x * (a + b), by replace_with(factored, bind=...)")
after = ex.rewrite(factor_pass, prog)
ex.check(
    ex.op_types(after) == ["add", "mul"] * 2,
    "both factored (the add of two constants is for coremltools' const_elimination to fold)",
)
names = [op.outputs[0].name for op in after.functions["main"].operations if op.op_type == "mul"]
ex.check(names == ["constants", "input_and_constant"], "the final outputs kept their names")
ex.compare(prog, after)
