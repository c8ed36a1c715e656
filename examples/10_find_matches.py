"""Match-only search: ``find_matches`` (TFLite's ``match_patterns()``, Intel's ``search_pattern``).

``find_matches(pattern, prog, var_constraints=None, **pattern_options)`` yields one ``Pattern`` per
distinct match, lazily (a match is looked for only when the next one is asked for), outer blocks first
and in program order, and never changes the program. Useful to count, inspect or report before writing
a transform; it takes the same pattern options as ``register_generic_pass``.

Shown: the SiLU ``x * sigmoid(x)`` found in a program with two inputs, one of unknown length; the
constraint being called only as the search advances; a constraint filtering the matches; and the
program text unchanged.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import find_matches
from pattern_infra import predicates as P


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
def silu(x):
    return mb.mul(x=x, y=mb.sigmoid(x=x, name="gate"), name="mul")


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3)), mb.TensorSpec(shape=(get_new_symbol(), 3))])
def prog(a, b):
    a = mb.mul(x=mb.sigmoid(x=a), y=a, name="silu_a1")
    a = mb.mul(x=a, y=mb.sigmoid(x=a), name="silu_a2")
    b = mb.mul(x=b, y=mb.sigmoid(x=b), name="silu_b")
    return mb.add(x=a, y=b)


def noisy(pattern):
    print(f"    (constraint called on {pattern.mul.name})")
    return True


ex.banner("the program")
ex.show(prog, "program")
before = str(prog)

ex.banner("lazy: the search advances only when asked")
matches = find_matches(silu, prog, noisy)
print("find_matches returned", type(matches).__name__, "- nothing searched yet")
first = next(matches)
print(f"first: {first}  root_var={first.root_var.name}  final_op={first.final_op.name}")
rest = list(matches)
print("the rest:", [m.mul.name for m in rest])

ex.banner("with a constraint: only SiLUs of tensors whose shape is known")
known = [m.mul.name for m in find_matches(silu, prog, lambda p: P.shape_known(p.root_var))]
print("matches:", known)
ex.check(known == ["silu_a1", "silu_a2"], "silu_b (input of unknown length) filtered out")
ex.check(str(prog) == before, "the program text is unchanged")
