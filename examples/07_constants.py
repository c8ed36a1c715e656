"""Pattern constants: ``constants="any" | "const" | "value"``, ``ConstRule`` and ``const_rules``.

A constant written in a pattern (``mb.mul(x=r, y=2.0)``) is a placeholder. What the program must have
in its slot:

* ``"any"`` (the default, as in the design document): any variable not computed inside the match; a
  program input, another op's output or a constant of any value. ``var_constraints`` checks the rest.
* ``"const"``: a compile-time constant, any value (TFLite's ``TensorHasData``).
* ``"value"``: a constant equal to the pattern's within rtol 1e-5, atol 1e-6; ``ConstRule("value",
  rtol=..., atol=...)`` sets the tolerance.
* ``const_rules={"<op>.<slot>": rule}`` sets a rule per constant, over the default ``constants=``.

In every mode, a constant slot never takes a value computed inside the match. The bound variable is
``pattern.consts["<op>.<slot>"]``.

Shown: which of five ``relu -> mul`` in one program match under each rule; a rule per constant; and
what "any" means when the pattern's constant sits next to its input in a commutative op.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb

from pattern_infra import ConstRule, find_matches


def spec(n=1):
    return [mb.TensorSpec(shape=(2, 3)) for _ in range(n)]  # one TensorSpec object per input


@mb.program(input_specs=spec())
def relu_times_two(x):
    return mb.mul(x=mb.relu(x=x, name="r"), y=2.0, name="m")


@mb.program(input_specs=spec(2))
def prog(x, w):
    def relu():
        return mb.relu(x=x)

    r = relu()
    return (
        mb.mul(x=relu(), y=2.0, name="times_2"),
        mb.mul(x=2.000001, y=relu(), name="times_2_swapped"),
        mb.mul(x=relu(), y=3.0, name="times_3"),
        mb.mul(x=relu(), y=w, name="times_input_w"),
        mb.mul(x=r, y=r, name="times_itself"),
    )


def matched(pattern, program, **options):
    found = list(find_matches(pattern, program, **options))
    return [m.final_op.name for m in found], found


ex.banner("one pattern, mul(relu(x), 2.0), under each rule")
ex.show(prog, "program")
results = {}
for label, options in [
    ('constants="any" (default)', {}),
    ('constants="const"', {"constants": "const"}),
    ('constants="value"', {"constants": "value"}),
    ('constants=ConstRule("value", rtol=0.6)', {"constants": ConstRule("value", rtol=0.6)}),
]:
    results[label], found = matched(relu_times_two, prog, **options)
    slots = ", ".join(f"{m.final_op.name}: m.y={ex.value_text(m.consts['m.y'])}" for m in found)
    print(f"{label:<42} {len(found)} match(es)  [{slots}]")
ex.check([len(v) for v in results.values()] == [4, 3, 2, 3], "any 4, const 3, value 2, loose value 3")
ex.check(
    all("times_itself" not in v for v in results.values()),
    "a constant slot fed from inside the match never matches",
)

ex.banner('const_rules: a rule per constant, here {"m.y": "value", "a.y": "const"}')


@mb.program(input_specs=spec())
def scale_shift(x):
    return mb.add(x=mb.mul(x=mb.relu(x=x, name="r"), y=2.0, name="m"), y=0.0, name="a")


@mb.program(input_specs=spec(2))
def shifted(x, w):
    def scaled(c):
        return mb.mul(x=mb.relu(x=x), y=c)

    return (
        mb.add(x=scaled(2.0), y=5.0, name="two_plus_5"),
        mb.add(x=scaled(3.0), y=5.0, name="three_plus_5"),
        mb.add(x=scaled(2.0), y=w, name="two_plus_input"),
    )


names, _ = matched(scale_shift, shifted, const_rules={"m.y": "value", "a.y": "const"})
print("matches:", names)
ex.check(names == ["two_plus_5"], "m.y must be 2.0, a.y any constant")

ex.banner('"any" is a wildcard: in a commutative op it may take the place of the input')


@mb.program(input_specs=spec())
def scaled_relu(x):
    return mb.relu(x=mb.mul(x=x, y=2.0, name="m"), name="r")


@mb.program(input_specs=spec())
def constant_first(x):
    return mb.relu(x=mb.mul(x=3.0, y=x))


ex.show(constant_first, "program")
for mode in ("any", "const"):
    (m,) = find_matches(scaled_relu, constant_first, constants=mode)
    root, slot = ex.value_text(m.root_var), ex.value_text(m.consts["m.y"])
    print(f'constants="{mode}": root_var={root:<4} m.y={slot}')
print(
    '-> with "any", mul(3.0, x) binds the constant 3.0 to the pattern input x and x to the constant '
    'slot; require "const" (or check pattern.root_var) when that matters'
)
