"""``common::fuse_gelu_tanh_approximation``: the tanh form of GELU into one ``gelu`` op.

Math: ``gelu(x) ~= 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))``, which is exactly what
``gelu(mode="TANH_APPROXIMATION")`` computes.

Two association orders occur in converted models, each with two ways of writing the cube; commutativity
of ``add`` and ``mul`` is handled by the matcher, so operand order never needs a pattern of its own::

    Pattern 1:  y = x * (0.5 * (tanh(sqrt(2/pi) * (x + 0.044715 * x^3)) + 1))

    x --> pow(3) --> mul(0.044715) --> add --> mul(sqrt(2/pi)) --> tanh --> add(1) --> mul(0.5) --> mul --> y
    |                                   ^                                                            ^
    |-----------------------------------|------------------------------------------------------------|

    Pattern 2:  y = (0.5 * x) * (tanh(sqrt(2/pi) * (x + 0.044715 * x^3)) + 1)

        x --> mul(0.5) -----------------------------------------------------------------------> mul --> y
        |                                                                                          ^
        |--> pow(3) --> mul(0.044715) --> add --> mul(sqrt(2/pi)) --> tanh --> add(1) ------------|
        |                                  ^
        |----------------------------------|

    Beyond coremltools: ``jax.nn.gelu(approximate=True)``, and code ported from it, writes the cube as
    ``x * x * x``. Converted from PyTorch that reaches the pass as two ``mul`` ops, ``mul(mul(x, x), x)``,
    where patterns 1 and 2 have ``pow(3)``; coremltools 9.0 leaves it unfused. Both patterns hold the
    cube as a choice (``one_of``), so each matches either spelling:

        x --> mul(x, x) --> mul --> mul(0.044715) --> add --> mul(sqrt(2/pi)) --> tanh --> add(1) --> ...
        |                    ^                         ^
        |--------------------|-------------------------|  (and x feeds the last mul as in pattern 1 / 2)

    All four spellings become:

        x --> gelu(mode="TANH_APPROXIMATION") --> y

Constants are checked by the pattern itself (``constants="value"``) with the tolerance coremltools'
pass uses (absolute 1e-3), so ``var_constraints`` is not needed. The ``gelu`` op is inserted where
coremltools' pass inserts it (before the ``mul(0.5)``) and takes the name of the output it replaces, so
with ``pow(3)`` the program is the one coremltools produces; the ``x * x * x`` cube rewrites the same way.
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, one_of, register_generic_pass

from ._gelu_common import GELU_CONSTANTS, replace_with_gelu

__all__ = ["gelu_tanh_pattern_1", "gelu_tanh_pattern_2", "transform_gelu_tanh"]

_SHAPE = [get_new_symbol(), get_new_symbol(), get_new_symbol()]


def _tanh_part(x):
    """``tanh(sqrt(2/pi) * (x + 0.044715 * x^3)) + 1``, the cube ``pow(x, 3)`` or ``x * x * x``."""
    cube = one_of(
        "cube",
        lambda: mb.pow(x=x, y=3.0, name="pow"),
        lambda: mb.mul(x=mb.mul(x=x, y=x, name="square"), y=x, name="cube_mul"),
    )
    mul_1 = mb.mul(x=0.044715, y=cube, name="mul_1")
    add = mb.add(x=x, y=mul_1, name="add")
    mul_2 = mb.mul(x=0.7978845834732056, y=add, name="mul_2")
    tanh = mb.tanh(x=mul_2, name="tanh")
    return mb.add(x=1.0, y=tanh, name="add_1")


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def gelu_tanh_pattern_1(x):
    mul = mb.mul(x=0.5, y=_tanh_part(x), name="mul")
    return mb.mul(x=mul, y=x, name="mul_3")


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def gelu_tanh_pattern_2(x):
    add_1 = _tanh_part(x)
    mul = mb.mul(x=0.5, y=x, name="mul")
    return mb.mul(x=mul, y=add_1, name="mul_3")


def transform_gelu_tanh(pattern: Pattern) -> None:
    """Inserts ``gelu(TANH_APPROXIMATION)`` and redirects the output; the framework removes the rest."""
    replace_with_gelu(pattern, "TANH_APPROXIMATION", out=pattern.mul_3, before=pattern.mul)


register_generic_pass(
    ops_arrangement=[gelu_tanh_pattern_1, gelu_tanh_pattern_2],
    var_constraints=None,
    transform_pattern=transform_gelu_tanh,
    pass_name="fuse_gelu_tanh_approximation",
    namespace="common",
    constants=GELU_CONSTANTS,
    name="gelu_tanh",
)
