"""``generic::fold_add_into_epsilon``: ``add(x, c)`` before ``rsqrt``, ``inverse`` or ``log`` into their
``epsilon``.

Math: MIL's ``rsqrt(v, epsilon)`` is ``1 / sqrt(v + epsilon)``, ``inverse(v, epsilon)`` is
``1 / (v + epsilon)`` and ``log(v, epsilon)`` is ``log(v + epsilon)`` (iOS15 ``elementwise_unary``). So
with a scalar constant ``c``::

    x --> add(c) --> rsqrt(epsilon=e) --> y      becomes      x --> rsqrt(epsilon=c + e) --> y

(and the same for ``inverse`` and ``log``): one op fewer on every norm that coremltools and our fusions
leave written out (an RMSNorm over another axis than the last, a norm in a model's own spelling).
``c + e`` is computed in float64 and rounded once to the dtype, so the result differs from the original
only by where ``x + c + e`` is rounded: at most one unit in the last place of the sum (``e`` defaults to
``1e-12`` for ``rsqrt``, far below float32's resolution of any ``c`` a norm uses).

Conditions: ``c`` a size-1 constant (not a constexpr), the add's output has ``x``'s shape and dtype (no
broadcast), and ``epsilon`` a constant. Runs after ``generic::fuse_rms_norm`` (whose patterns read the
epsilon from both places), override on.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

import generic_passes.fuse_rms_norm  # noqa: F401  (registers generic::fuse_rms_norm, which this pass follows)
from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = ["UNARY_WITH_EPSILON", "add_epsilon_pattern", "fold_add_constraints", "transform_fold_add"]

UNARY_WITH_EPSILON: tuple[str, ...] = ("rsqrt", "inverse", "log")
"""The ops whose ``epsilon`` is added to their input."""


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))])
def add_epsilon_pattern(x):
    v = mb.add(x=x, y=1e-6, name="add")
    return mb.rsqrt(x=v, name="unary")


def _scalar(var) -> float | None:
    if not predicates.is_constant(var) or predicates.is_constexpr(var):
        return None
    value = np.asarray(var.val, dtype=np.float64)
    return float(value.reshape(())) if value.size == 1 else None


def fold_add_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Scalar constant ``c``, no broadcast, constant epsilon, fp16/fp32.

    Returns:
        True, or ``(False, reason)``.
    """
    x, out = pattern.operand("add", "x"), pattern.add.outputs[0]
    c, e = _scalar(pattern.operand("add", "y")), _scalar(pattern.unary.epsilon)
    if c is None:
        return False, "the added value is not a one-element constant"
    if e is None:
        return False, f"{pattern.unary.op_type}'s epsilon is not a constant"
    if x.shape != out.shape or x.dtype != out.dtype:
        return False, "the add broadcasts x to another shape or dtype"
    if not predicates.dtype_is(x, "fp16", "fp32"):
        return False, "x is not fp16 or fp32"
    pattern.add_attribute("total_epsilon", c + e)
    return True


def transform_fold_add(pattern: Pattern) -> None:
    """The same unary op on ``x`` with ``epsilon = c + e``."""
    op = pattern.unary
    x = pattern.operand("add", "x")
    epsilon = pattern.const_like(pattern.total_epsilon, like=x, before_op=op)
    new = getattr(mb, op.op_type)(x=x, epsilon=epsilon, name=op.outputs[0].name, before_op=op)
    pattern.replace_output(new)


register_generic_pass(
    ops_arrangement=add_epsilon_pattern,
    var_constraints=fold_add_constraints,
    transform_pattern=transform_fold_add,
    pass_name="fold_add_into_epsilon",
    namespace="generic",
    alternatives={"unary": list(UNARY_WITH_EPSILON)},
    constants="const",
    name="add_into_epsilon",
    run_after="generic::fuse_rms_norm",
)
