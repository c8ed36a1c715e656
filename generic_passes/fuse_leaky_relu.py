"""``common::fuse_leaky_relu``: ``maximum(alpha * x, x)`` into one ``leaky_relu`` op.

Math: for ``0 <= alpha <= 1``, ``max(alpha * x, x)`` is ``x`` when ``x >= 0`` and ``alpha * x`` when
``x < 0``, which is ``leaky_relu(x, alpha)``. For ``alpha > 1`` or ``alpha < 0`` the maximum picks the
other branch, so the range is part of the rule.

Commutativity of ``mul`` and ``maximum`` is handled by the matcher, so ``max(x, x * alpha)`` is the same
pattern::

    x --> mul(alpha) --> maximum --> y          alpha: constant with one element, 0 <= alpha <= 1
    |                      ^
    |----------------------|

    becomes:

    x --> leaky_relu(alpha) --> y

As coremltools does, ``alpha`` is passed on as the constant's value (same shape and dtype), the
``leaky_relu`` is inserted before the ``maximum`` and takes the name of the output it replaces.
``var_constraints`` checks what the pattern cannot: ``alpha`` has one element in ``[0, 1]``; and adds two
refusals coremltools does not have: ``x`` must be fp16/fp32, the types ``leaky_relu`` accepts (coremltools'
pass raises on an integer ``max(x * 1, x)``), and the output must have the shape of ``x`` (a size-1
``alpha`` of higher rank broadcasts it; coremltools fuses anyway and silently changes the output shape).
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types

from pattern_infra import Pattern, register_generic_pass

__all__ = ["leaky_relu_pattern", "leaky_relu_constraints", "transform_leaky_relu"]

_SHAPE = [get_new_symbol(), get_new_symbol(), get_new_symbol()]


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def leaky_relu_pattern(x):
    mul = mb.mul(x=x, y=0.2, name="mul")
    return mb.maximum(x=mul, y=x, name="maximum")


def leaky_relu_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """``alpha`` is one value in ``[0, 1]``; ``x`` is fp16/fp32; the output has the shape of ``x``.

    Returns:
        True, or ``(False, reason)``.
    """
    alpha = np.asarray(pattern.consts["mul.y"].val)
    if alpha.size != 1:
        return False, f"alpha has {alpha.size} elements, not one"
    if not 0 <= alpha.reshape(-1)[0] <= 1:
        return False, f"alpha is {float(alpha.reshape(-1)[0])}, not in [0, 1]"
    x, y = pattern.root_var, pattern.maximum.outputs[0]
    if x.dtype not in (types.fp16, types.fp32):
        return False, "x is not fp16 or fp32"
    if x.shape != y.shape:
        return False, "the maximum broadcasts x to another shape"
    return True


def transform_leaky_relu(pattern: Pattern) -> None:
    """Inserts ``leaky_relu`` before the ``maximum`` and redirects the output to it."""
    lrelu = mb.leaky_relu(
        x=pattern.root_var,
        alpha=pattern.consts["mul.y"].val,
        name=pattern.maximum.outputs[0].name,
        before_op=pattern.maximum,
    )
    pattern.replace_output(lrelu)


register_generic_pass(
    ops_arrangement=leaky_relu_pattern,
    var_constraints=leaky_relu_constraints,
    transform_pattern=transform_leaky_relu,
    pass_name="fuse_leaky_relu",
    namespace="common",
    const_rules={"mul.y": "const"},
    name="leaky_relu",
)
