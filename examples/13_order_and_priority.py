"""Order of sub-passes: registration order, ``priority=``, and ``container.order`` to see it.

Sub-passes of one pass run one after the other, each over the whole program: higher ``priority`` first,
then in registration order (Intel's ``supported_patterns`` order). When two patterns overlap, the one
that runs first takes the ops. Here, both rewrites are correct::

    "square":  mul(x, x)        -> square(x)
    "abs":     sqrt(mul(x, x))  -> abs(x)

but if "square" runs first, it turns the ``mul`` inside ``sqrt(mul(x, x))`` into a ``square`` and "abs"
finds nothing; giving "abs" a higher priority lets the larger pattern win.

Shown: ``container.order`` and the program after each of two passes built from the same patterns.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb

from pattern_infra import register_generic_pass

SPEC = [mb.TensorSpec(shape=(2, 3))]


@mb.program(input_specs=SPEC)
def x_times_x(x):
    return mb.mul(x=x, y=x, name="mul")


@mb.program(input_specs=SPEC)
def sqrt_of_x_times_x(x):
    return mb.sqrt(x=mb.mul(x=x, y=x, name="mul"), name="sqrt")


def to_square(pattern):
    last = pattern.final_op
    pattern.replace_output(mb.square(x=pattern.root_var, name=last.outputs[0].name, before_op=last))


def to_abs(pattern):
    last = pattern.final_op
    pattern.replace_output(mb.abs(x=pattern.root_var, name=last.outputs[0].name, before_op=last))


@mb.program(input_specs=SPEC)
def prog(x):
    norm = mb.sqrt(x=mb.mul(x=x, y=x), name="norm")
    return mb.mul(x=norm, y=norm, name="norm_squared")


ex.banner("registration order: square, then abs")
register_generic_pass(x_times_x, None, to_square, "by_registration", "examples", name="square")
by_registration = register_generic_pass(
    sqrt_of_x_times_x, None, to_abs, "by_registration", "examples", name="abs"
)
print("order:", by_registration.order)
after = ex.rewrite(by_registration, prog)
ex.check(ex.op_types(after) == ["square", "sqrt", "square"], "square took the mul inside the sqrt")
ex.compare(prog, after)

ex.banner("same registrations, abs with priority=1")
register_generic_pass(x_times_x, None, to_square, "by_priority", "examples", name="square")
by_priority = register_generic_pass(
    sqrt_of_x_times_x, None, to_abs, "by_priority", "examples", name="abs", priority=1
)
print("order:", by_priority.order)
after = ex.rewrite(by_priority, prog)
ex.check(ex.op_types(after) == ["abs", "square"], "abs ran first and took sqrt(x * x)")
ex.compare(prog, after)
