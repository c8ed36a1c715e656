"""``common::fuse_gelu_exact``: the erf form of GELU into one ``gelu(mode="EXACT")`` op.

Math: ``gelu(x) = 0.5 * x * (1 + erf(x / sqrt(2)))``, which is exactly what ``gelu(mode="EXACT")``
computes. ``x / sqrt(2)`` is written either as ``real_div(x, sqrt(2))`` or, after coremltools'
``divide_to_multiply``, as ``mul(x, 1 / sqrt(2))``; the three ways of multiplying by ``0.5`` and by
``x`` give three tails. Commutativity of ``add`` and ``mul`` is handled by the matcher, so two scalings
times three tails make the six patterns::

    Scaling:   x --> real_div(sqrt(2)) --> erf --> add(1) --> e        (or mul(1/sqrt(2)) instead of real_div)

    Tail 1:  y = ((erf(...) + 1) * 0.5) * x

        x --> scale --> erf --> add(1) --> mul(0.5) --> mul --> y
        |                                                ^
        |------------------------------------------------|

    Tail 2:  y = ((erf(...) + 1) * x) * 0.5

        x --> scale --> erf --> add(1) --> mul --> mul(0.5) --> y
        |                                   ^
        |-----------------------------------|

    Tail 3:  y = (erf(...) + 1) * (0.5 * x)

        x --> scale --> erf --> add(1) --> mul --> y
        |                                   ^
        |--> mul(0.5) ----------------------|

    All six become:

        x --> gelu(mode="EXACT") --> y

Constants are checked by the pattern (``constants="value"``) with the tolerance of coremltools' pass
(absolute 1e-3); a constant must hold one element. The ``gelu`` op is inserted where coremltools inserts
it (before the scaling op) and takes the name of the output it replaces, so the program is the one
coremltools produces. ``var_constraints`` adds one refusal coremltools does not have: a size-1 constant
of higher rank than ``x`` broadcasts the output to another shape than ``gelu(x)``'s; coremltools fuses it
anyway and silently changes the shape of the output (and of a block output), we decline.

This pass also holds the quick-GELU fusion ``x * sigmoid(1.702 * x)`` registered by
``fuse_gelu_sigmoid_approximation.py`` (see its docstring), so that it runs in coremltools' default
pipeline under the override.
"""

from __future__ import annotations

from collections.abc import Callable

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var, get_new_symbol

from pattern_infra import Pattern, register_generic_pass

from ._gelu_common import GELU_CONSTANTS, keeps_shape_and_dtype, replace_with_gelu

__all__ = ["GELU_EXACT_PATTERNS", "gelu_exact_constraints", "transform_gelu_exact"]

_SHAPE = [get_new_symbol(), get_new_symbol(), get_new_symbol()]


def _scale_by_div(x: Var) -> Var:
    return mb.real_div(x=x, y=2.0**0.5, name="scale")


def _scale_by_mul(x: Var) -> Var:
    return mb.mul(x=x, y=2.0**-0.5, name="scale")


def _tail_half_then_x(x: Var, erf_plus_1: Var) -> Var:
    half = mb.mul(x=erf_plus_1, y=0.5, name="half")
    return mb.mul(x=half, y=x, name="out")


def _tail_x_then_half(x: Var, erf_plus_1: Var) -> Var:
    times_x = mb.mul(x=erf_plus_1, y=x, name="times_x")
    return mb.mul(x=times_x, y=0.5, name="out")


def _tail_half_x(x: Var, erf_plus_1: Var) -> Var:
    half_x = mb.mul(x=x, y=0.5, name="half_x")
    return mb.mul(x=erf_plus_1, y=half_x, name="out")


def _gelu_exact_pattern(scale: Callable[[Var], Var], tail: Callable[[Var, Var], Var]) -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
    def gelu_exact(x):
        erf = mb.erf(x=scale(x), name="erf")
        add = mb.add(x=erf, y=1.0, name="add")
        return tail(x, add)

    return gelu_exact


GELU_EXACT_PATTERNS: list[Program] = [
    _gelu_exact_pattern(scale, tail)
    for scale in (_scale_by_div, _scale_by_mul)
    for tail in (_tail_half_then_x, _tail_x_then_half, _tail_half_x)
]
"""The six patterns: ``real_div`` then ``mul`` scaling, each with tails 1, 2, 3 of the docstring."""


def gelu_exact_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Declines a match whose output does not have the shape and dtype of ``x`` (broadcast constant)."""
    return keeps_shape_and_dtype(pattern, pattern.out) or (
        False,
        "the output does not have the shape and dtype of x (a constant broadcasts it)",
    )


def transform_gelu_exact(pattern: Pattern) -> None:
    """Inserts ``gelu(EXACT)`` before the scaling op and redirects the output to it."""
    replace_with_gelu(pattern, "EXACT", out=pattern.out, before=pattern.scale)


register_generic_pass(
    ops_arrangement=GELU_EXACT_PATTERNS,
    var_constraints=gelu_exact_constraints,
    transform_pattern=transform_gelu_exact,
    pass_name="fuse_gelu_exact",
    namespace="common",
    constants=GELU_CONSTANTS,
    name="gelu_exact",
)
