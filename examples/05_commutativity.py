"""Commutativity: written once in the pattern, matched in either operand order.

``add``, ``mul``, ``maximum``, ``minimum`` and the other ops in ``COMMUTATIVE_OPS`` match with ``x`` and
``y`` either way round; nothing to list per rule. ``sub`` is not commutative and matches only in the
written order. ``commutative=False`` switches swapping off, ``commutative=["name"]`` allows it for named
pattern ops only. In a match, ``pattern.mul.x`` is the program's ``x`` operand, and
``pattern.operand("mul", "x")`` the one that stands where the *pattern* wrote ``x``.

Shown: matches of a SiLU pattern ``x * sigmoid(x)`` in a program that writes it both ways, under each
setting; then the same for a non-commutative ``sub``.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb

from pattern_infra import COMMUTATIVE_OPS, find_matches

SPEC = [mb.TensorSpec(shape=(2, 3))]


@mb.program(input_specs=SPEC)
def silu(x):
    return mb.mul(x=x, y=mb.sigmoid(x=x, name="gate"), name="mul")


@mb.program(input_specs=SPEC)
def prog(x):
    a = mb.mul(x=x, y=mb.sigmoid(x=x), name="x_times_gate")
    return mb.mul(x=mb.sigmoid(x=a), y=a, name="gate_times_x")


def report(title, matches):
    print(f"{title}: {len(matches)} match(es)")
    for m in matches:
        print(f"  {m.mul.name}: program x={m.mul.x.name:<14} pattern's x={m.operand('mul', 'x').name}")
    return len(matches)


ex.banner("SiLU written as x * sigmoid(x) and sigmoid(x) * x")
print("commutative ops:", ", ".join(sorted(COMMUTATIVE_OPS)))
ex.show(prog, "program")
counts = [
    report("default (commutative=True)", list(find_matches(silu, prog))),
    report("commutative=False", list(find_matches(silu, prog, commutative=False))),
    report('commutative=["mul"]', list(find_matches(silu, prog, commutative=["mul"]))),
]
ex.check(counts == [2, 1, 2], "both orders match unless swapping is switched off")


@mb.program(input_specs=SPEC)
def relu_minus_x(x):
    return mb.sub(x=mb.relu(x=x, name="r"), y=x, name="s")


@mb.program(input_specs=SPEC)
def sub_prog(x):
    a = mb.sub(x=mb.relu(x=x), y=x, name="relu_minus_x")
    return mb.sub(x=a, y=mb.relu(x=a), name="x_minus_relu")


ex.banner("sub is not commutative: relu(x) - x does not match x - relu(x)")
ex.show(sub_prog, "program")
found = [m.s.name for m in find_matches(relu_minus_x, sub_prog)]
print("matches of relu(x) - x:", found)
ex.check(found == ["relu_minus_x"], "only the written order of sub matches")
