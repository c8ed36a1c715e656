"""``common::fuse_prelu``: ``relu(x) + a * relu(-x)`` into one ``prelu`` op.

Math: ``relu(x) + a * relu(-1 * x)`` is ``x`` where ``x >= 0`` and ``-a * x`` where ``x < 0``: a
``prelu`` with ``alpha = -a``, when ``a`` holds one value per channel.

Pattern 1: ``x`` is BCHW and ``a`` has shape ``(C, 1, 1)`` or ``(1, C, 1, 1)``::

                   |------------> relu ------------------------|
                   |                                           v
        x (BCHW) --|                                          add --> y (BCHW)
                   |                                           ^
                   |--> mul(-1) --> relu --> mul(a) -----------|

    becomes:

        x (BCHW) --> prelu(alpha=-a.flatten()) --> y (BCHW)

Pattern 2: the same on ``transpose(x, perm=[0, 2, 3, 1])`` (BHWC), ``a`` of shape ``(C,)``, ``(1, C)``,
``(1, 1, C)`` or ``(1, 1, 1, C)``::

                                      |------------> relu ---------------------|
                                      |                                        v
        x (BCHW) --> transpose(BHWC) -|                                       add --> y (BHWC)
                                      |                                        ^
                                      |--> mul(-1) --> relu --> mul(a) --------|

    becomes:

        x (BCHW) --> prelu(alpha=-a.flatten()) --> transpose(perm=[0, 2, 3, 1]) --> y (BHWC)

Commutativity of ``mul`` and ``add`` is handled by the matcher. Pattern 1 runs before pattern 2, as in
coremltools. The ``-1`` is checked by the pattern with coremltools' tolerance (absolute 1e-3), the perm
exactly; ``a`` must be a compile-time constant (``const_rules``), and ``var_constraints`` checks ranks
and the shape of ``a`` as coremltools does. One refusal is added, where coremltools' pass would raise:
``prelu`` needs ``len(alpha) == x.shape[1]`` (a size-1 ``a`` on several channels, or a symbolic channel
dimension, is declined). The replacement is inserted before the ``add`` and takes the name of its output;
in pattern 2 the ``prelu`` gets an automatic name and the ``transpose`` the output's name, as in
coremltools.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var, get_new_symbol

from pattern_infra import ConstRule, Pattern, register_generic_pass
from pattern_infra.language.graph import ConstMode

__all__ = [
    "prelu_pattern_1",
    "prelu_pattern_2",
    "prelu_constraints_1",
    "prelu_constraints_2",
    "transform_prelu_1",
    "transform_prelu_2",
]

_SHAPE = [get_new_symbol(), get_new_symbol(), get_new_symbol(), get_new_symbol()]


def _relu_plus_scaled_relu_of_neg(x: Var) -> Var:
    neg = mb.mul(x=x, y=-1.0, name="neg")
    relu1 = mb.relu(x=neg, name="relu1")
    alpha_mul = mb.mul(x=relu1, y=np.ones((1, 1, 1, 1), dtype=np.float32), name="alpha_mul")
    relu2 = mb.relu(x=x, name="relu2")
    return mb.add(x=relu2, y=alpha_mul, name="out_op")


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def prelu_pattern_1(x):
    return _relu_plus_scaled_relu_of_neg(x)


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def prelu_pattern_2(x):
    transpose = mb.transpose(x=x, perm=[0, 2, 3, 1], name="transpose")
    return _relu_plus_scaled_relu_of_neg(transpose)


def _alpha(pattern: Pattern) -> np.ndarray:
    return np.asarray(pattern.consts["alpha_mul.y"].val)


def _fits_prelu(pattern: Pattern, alpha: np.ndarray) -> bool:
    """``prelu`` itself demands one ``alpha`` per channel of its input (``x.shape[1]``)."""
    return pattern.root_var.shape[1] == alpha.size


def prelu_constraints_1(pattern: Pattern) -> bool | tuple[bool, str]:
    """Rank-4 ``x`` and output; ``a`` of shape ``(C, 1, 1)`` or ``(1, C, 1, 1)``."""
    alpha = _alpha(pattern)
    if pattern.root_var.rank != 4 or pattern.out_op.outputs[0].rank != 4:
        return False, f"x of rank {pattern.root_var.rank}, not 4"
    if not (alpha.ndim in (3, 4) and alpha.size == alpha.shape[-3] and _fits_prelu(pattern, alpha)):
        return False, f"alpha of shape {alpha.shape} is not one value per channel of x"
    return True


def prelu_constraints_2(pattern: Pattern) -> bool | tuple[bool, str]:
    """Rank-4 output; ``a`` of shape ``(C,)``, ``(1, C)``, ``(1, 1, C)`` or ``(1, 1, 1, C)``."""
    alpha = _alpha(pattern)
    if pattern.out_op.outputs[0].rank != 4:
        return False, f"an output of rank {pattern.out_op.outputs[0].rank}, not 4"
    if not (alpha.ndim >= 1 and alpha.size == alpha.shape[-1] and _fits_prelu(pattern, alpha)):
        return False, f"alpha of shape {alpha.shape} is not one value per channel of x"
    return True


def transform_prelu_1(pattern: Pattern) -> None:
    """Inserts ``prelu(x, -a)`` before the ``add`` and redirects the output to it."""
    prelu = mb.prelu(
        x=pattern.root_var,
        alpha=-1 * _alpha(pattern).flatten(),
        name=pattern.out_op.outputs[0].name,
        before_op=pattern.out_op,
    )
    pattern.replace_output(prelu)


def transform_prelu_2(pattern: Pattern) -> None:
    """Inserts ``prelu(x, -a)`` then the transpose before the ``add``; redirects the output."""
    prelu = mb.prelu(x=pattern.root_var, alpha=-1 * _alpha(pattern).flatten(), before_op=pattern.out_op)
    transpose = mb.transpose(
        x=prelu,
        perm=pattern.transpose.perm.val,
        name=pattern.out_op.outputs[0].name,
        before_op=pattern.out_op,
    )
    pattern.replace_output(transpose)


_CONST_RULES: dict[str, ConstMode | ConstRule] = {
    "neg.y": ConstRule("value", rtol=0.0, atol=1e-3),
    "alpha_mul.y": "const",
}

register_generic_pass(
    ops_arrangement=prelu_pattern_1,
    var_constraints=prelu_constraints_1,
    transform_pattern=transform_prelu_1,
    pass_name="fuse_prelu",
    namespace="common",
    const_rules=_CONST_RULES,
    name="prelu_bchw",
)

register_generic_pass(
    ops_arrangement=prelu_pattern_2,
    var_constraints=prelu_constraints_2,
    transform_pattern=transform_prelu_2,
    pass_name="fuse_prelu",
    namespace="common",
    const_rules={**_CONST_RULES, "transpose.perm": ConstRule("value", rtol=0.0, atol=0.0)},
    name="prelu_bhwc",
)
