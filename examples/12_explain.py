"""Why does my pattern not match? ``explain(pattern, prog)`` reports the nearest partial matches.

``explain`` tries every pattern op as the anchor at every program op of its type, and reports for the
attempts that got furthest how many pattern ops were bound, to which program ops, and the first reason
the search gave up; complete matches go on to ``var_constraints`` and, if given, the transform (run on
a copy). It takes the pattern options of ``register_generic_pass`` and never changes the program.

The pattern is ``relu(x) * 2 - x`` with ``constants="value"``. Shown: the report on a program that
matches, then on three that almost do: a wrong constant, an intermediate with an extra consumer, and
the operands of the (non-commutative) ``sub`` swapped.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb

from pattern_infra import explain

SPEC = [mb.TensorSpec(shape=(2, 3))]


@mb.program(input_specs=SPEC)
def pattern(x):
    scaled = mb.mul(x=mb.relu(x=x, name="r"), y=2.0, name="m")
    return mb.sub(x=scaled, y=x, name="s")


def program(scale=2.0, extra_consumer=False, swapped=False):
    @mb.program(input_specs=SPEC)
    def prog(x):
        scaled = mb.mul(x=mb.relu(x=x, name="relu"), y=scale, name="scaled")
        out = mb.sub(x=x, y=scaled, name="out") if swapped else mb.sub(x=scaled, y=x, name="out")
        return mb.add(x=out, y=mb.sin(x=scaled, name="leak")) if extra_consumer else out

    return prog


cases = {
    "matching program": (program(), "1 full match"),
    "wrong constant (3.0 where the pattern has 2.0)": (program(scale=3.0), "constant differs"),
    "intermediate 'scaled' also read by a sin": (program(extra_consumer=True), "extra consumer"),
    "sub operands swapped: x - relu(x) * 2": (program(swapped=True), "operand slot differs"),
}
for title, (prog, expected) in cases.items():
    ex.banner(title)
    print(ex.listing(prog))
    before = str(prog)
    report = str(explain(pattern, prog, constants="value"))
    print(report)
    ex.check(expected in report and str(prog) == before, f"report says {expected!r}; program unchanged")
