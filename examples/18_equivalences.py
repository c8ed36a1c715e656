"""Equivalences the matcher knows: ``equivalences=True`` (or a list, or per op).

The pattern is written once, in one spelling; identities of single ops let it match the others without
a pattern each: ``pow(x, 2)`` = ``mul(x, x)`` (exact), ``sub(x, c)`` = ``add(x, -c)`` (exact),
``real_div(x, c)`` = ``mul(x, 1/c)`` (within 3 ulp in float32), ``rsqrt(v)`` = ``real_div(1, sqrt(v))``.
Here a "mean of squares minus a constant" pattern::

    x --> pow(2) "sq" --> reduce_mean "mean" --> sub(0.5) "shift" --> y
    also matches   x --> mul(x, x) --> reduce_mean --> add(-0.5) --> y        (and the two mixed forms)

Shown: which spellings match with the equivalences off and on, ``pattern.choices`` telling which
spelling matched, a wrong constant still refused under ``constants="value"`` (the other spelling's
constant is the pattern's, transformed: -0.5 for ``add``), and an identity declared where it does not
hold, refused.
"""

import _common as ex
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import PatternDefinitionError, find_matches

SPEC = [mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))]


@mb.program(input_specs=SPEC)
def centered_power(x):
    sq = mb.pow(x=x, y=np.float32(2.0), name="sq")
    mean = mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="mean")
    return mb.sub(x=mean, y=np.float32(0.5), name="shift")


def program(square, shift):
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4))])
    def prog(x):
        sq = mb.pow(x=x, y=np.float32(2.0)) if square == "pow" else mb.mul(x=x, y=x)
        mean = mb.reduce_mean(x=sq, axes=[-1], keep_dims=True)
        return mb.sub(x=mean, y=np.float32(shift)) if shift > 0 else mb.add(x=mean, y=np.float32(shift))

    return prog


ex.banner("1. four spellings, matched with and without equivalences")
rows = []
for square in ("pow", "mul"):
    for shift in (0.5, -0.5):
        prog = program(square, shift)
        off = list(find_matches(centered_power, prog, constants="value"))
        on = list(find_matches(centered_power, prog, constants="value", equivalences=True))
        spelled = f"{square}, {'sub(0.5)' if shift > 0 else 'add(-0.5)'}"
        print(f"  {spelled:<16} off: {len(off)} match   on: {len(on)} match, choices {on[0].choices}")
        rows.append((len(off), len(on)))
ex.check(rows == [(1, 1), (0, 1), (0, 1), (0, 1)], "off: only the written spelling; on: all four")

ex.banner("2. constants keep their meaning")
wrong = program("mul", -0.25)  # add(-0.25) is sub(0.25), not sub(0.5)
ex.check(
    list(find_matches(centered_power, wrong, constants="value", equivalences=True)) == [],
    "add(-0.25) is refused: the other spelling of sub(0.5) is add(-0.5)",
)

ex.banner("3. an identity where it does not hold is refused at registration")
try:
    list(find_matches(centered_power, wrong, equivalences={"mean": ["pow2"]}))
except PatternDefinitionError as error:
    print(f"PatternDefinitionError: {error}")
    ex.check("does not hold" in str(error) and "Fix" in str(error), "refused with the rule and the fix")
else:
    ex.check(False, "refused")
