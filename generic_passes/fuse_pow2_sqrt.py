"""``mil_backend::fuse_pow2_sqrt``: ``sqrt(pow(x, 2))`` into ``abs(x)``, ``pow(sqrt(x), 2)`` into
``identity(x)``.

Math: ``sqrt(x^2) = |x|`` for every real ``x``; ``(sqrt(x))^2 = x`` wherever ``sqrt(x)`` is defined
(``x >= 0``; for ``x < 0`` the original is NaN)::

    Pattern 1:  x --> pow(2) --> sqrt --> y        becomes     x --> abs --> y

    Pattern 2:  x --> sqrt --> pow(2) --> y        becomes     x --> identity --> y

Deliberate difference from coremltools 9.0, whose pass turns *both* forms into ``identity(x)``: for
pattern 1 that flips the sign of every negative input (``sqrt((-2)^2) = 2``, ``identity(-2) = -2``), a
rewrite that changes what the model computes. Ours emits ``abs`` there, with the name and position
coremltools gives its ``identity``; pattern 2 gives coremltools' program exactly.

As in coremltools, the exponent is any constant whose values are all exactly ``2``, the first op must have
no other consumer and not be a block output (the matcher's rule for intermediates), and the new op is
inserted before the first op and takes the name of the output it replaces.

``var_constraints`` also reproduces coremltools' choice on chains such as ``sqrt -> pow(2) -> sqrt``:
coremltools scans ops in program order and fuses the first pair it meets, while pattern 1 runs over the
whole block before pattern 2. So pattern 1 declines a ``pow`` whose input is a ``sqrt`` that pattern 2
would fuse with it (that pair comes first in program order). One refusal is added: the output must have
the shape and dtype of ``x`` (an exponent of higher rank broadcasts it; coremltools fuses anyway and
silently changes the output shape).
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, get_new_symbol

from pattern_infra import Pattern, register_generic_pass

__all__ = [
    "pow2_sqrt_pattern",
    "sqrt_pow2_pattern",
    "pow2_sqrt_constraints",
    "sqrt_pow2_constraints",
    "transform_pow2_sqrt",
]

_SHAPE = [get_new_symbol(), get_new_symbol(), get_new_symbol()]


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def pow2_sqrt_pattern(x):
    pow = mb.pow(x=x, y=2.0, name="pow")
    return mb.sqrt(x=pow, name="sqrt")


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def sqrt_pow2_pattern(x):
    sqrt = mb.sqrt(x=x, name="sqrt")
    return mb.pow(x=sqrt, y=2.0, name="pow")


def _squares(pow_op: Operation) -> bool:
    return pow_op.y.val is not None and bool(np.all(pow_op.y.val == 2))


def _keeps_type(pattern: Pattern) -> bool:
    x, y = pattern.root_var, pattern.final_op.outputs[0]
    return x.dtype == y.dtype and x.shape == y.shape


def _sqrt_pow2_pair_ends_at(pow_op: Operation) -> bool:
    """Whether ``pow_op`` reads a ``sqrt`` that pattern 2 would fuse with it."""
    sqrt_op = pow_op.x.op
    if sqrt_op is None or sqrt_op.op_type != "sqrt" or sqrt_op.enclosing_block is not pow_op.enclosing_block:
        return False
    out = sqrt_op.outputs[0]
    return len(out.child_ops) == 1 and not out.consuming_blocks and _squares(pow_op)


def pow2_sqrt_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Exponent all 2, type kept, and no ``sqrt -> pow`` pair before this one (coremltools' order)."""
    verdict = sqrt_pow2_constraints(pattern)
    if verdict is not True:
        return verdict
    if _sqrt_pow2_pair_ends_at(pattern.pow):
        return False, "the pow reads a sqrt fused with it first (sqrt -> pow)"
    return True


def sqrt_pow2_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Exponent all 2 and type kept."""
    if not _squares(pattern.pow):
        return False, "the exponent is not 2"
    if not _keeps_type(pattern):
        return False, "the output does not have the shape and dtype of x"
    return True


def transform_pow2_sqrt(pattern: Pattern) -> None:
    """Inserts ``abs(x)`` (pattern 1) or ``identity(x)`` (pattern 2) before the first op."""
    first = pattern.op_list()[0]
    build = mb.abs if first.op_type == "pow" else mb.identity
    new = build(x=pattern.root_var, name=pattern.final_op.outputs[0].name, before_op=first)
    pattern.replace_output(new)


for _pattern, _constraints, _name in (
    (pow2_sqrt_pattern, pow2_sqrt_constraints, "pow2_sqrt"),
    (sqrt_pow2_pattern, sqrt_pow2_constraints, "sqrt_pow2"),
):
    register_generic_pass(
        ops_arrangement=_pattern,
        var_constraints=_constraints,
        transform_pattern=transform_pow2_sqrt,
        pass_name="fuse_pow2_sqrt",
        namespace="mil_backend",
        const_rules={"pow.y": "const"},
        name=_name,
    )
