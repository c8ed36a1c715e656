"""``generic::fuse_hard_swish``: coremltools' three-op hard swish, ``thresholded_relu`` dropped.

coremltools converts ``torch.nn.Hardswish`` (MobileNetV3, EfficientViT, ...) to three ops: the input
clamped at -3 by ``thresholded_relu``, then ``w * sigmoid_hard(w)``. The clamp changes nothing the product
does not already do, so two ops compute the same.

Math: ``thresholded_relu(x, t)`` is ``x`` where ``x >= t`` and 0 elsewhere; ``sigmoid_hard(x, a, b)`` is
``min(max(a * x + b, 0), 1)``. With ``a > 0`` and ``a * t + b <= 0`` (coremltools writes ``t = -3``,
``a = 1/6``, ``b = 1/2``: ``a * t + b = 0``), ``sigmoid_hard`` is 0 at every ``x <= t``, so where the
clamp would make ``w = 0`` the product ``x * sigmoid_hard(x)`` is already 0; above ``t``, ``w = x``. So
``w * sigmoid_hard(w) == x * sigmoid_hard(x)`` for every finite ``x`` (at ``x = -inf`` the product is NaN
where the clamp gave 0: an input no finite model reaches)::

    x --> thresholded_relu(t) --> w --> sigmoid_hard(a, b) --> s --> mul --> y
                                  |                                  ^
                                  |----------------------------------|

    becomes:

    x --> sigmoid_hard(a, b) --> s --> mul --> y
    |                                  ^
    |----------------------------------|

No MIL op computes hard swish in one (iOS18's opset has none); two ops is the shortest form. The
constants are read as the program holds them (a saved package's numpy scalars, float16 or float32), and
``a * t + b <= 0`` is checked with the tolerance of their dtype.
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = ["hard_swish_constraints", "hard_swish_pattern", "transform_hard_swish"]


@mb.program(input_specs=[mb.TensorSpec(shape=[get_new_symbol(), get_new_symbol()])])
def hard_swish_pattern(x):
    w = mb.thresholded_relu(x=x, alpha=-3.0, name="clamp")
    s = mb.sigmoid_hard(x=w, alpha=1.0 / 6, beta=0.5, name="gate")
    return mb.mul(x=w, y=s, name="product")


def hard_swish_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """``sigmoid_hard`` rises (``a > 0``) and is 0 at the clamp's threshold (``a * t + b <= 0``).

    Returns:
        True, or ``(False, reason)``.
    """
    t, a, b = (predicates.value_of(v) for v in (pattern.clamp.alpha, pattern.gate.alpha, pattern.gate.beta))
    if not all(isinstance(v, float) for v in (t, a, b)):
        return False, "the threshold or sigmoid_hard's alpha/beta is not one constant"
    if a <= 0:
        return False, f"sigmoid_hard's alpha is {a}, not positive: it does not vanish below the threshold"
    if a * t + b > predicates.dtype_rtol(pattern.gate.alpha) * (abs(a * t) + abs(b)):
        return False, f"sigmoid_hard is {a * t + b:.3g}, not 0, at the threshold {t}: the clamp matters"
    return True


def transform_hard_swish(pattern: Pattern) -> None:
    """``x * sigmoid_hard(x)``, with the gate's constants and the product's name."""
    x, gate, product = pattern.root_var, pattern.gate, pattern.product
    s = mb.sigmoid_hard(x=x, alpha=gate.alpha.val, beta=gate.beta.val, before_op=product)
    pattern.replace_output(mb.mul(x=x, y=s, name=product.outputs[0].name, before_op=product))


register_generic_pass(
    ops_arrangement=hard_swish_pattern,
    var_constraints=hard_swish_constraints,
    transform_pattern=transform_hard_swish,
    pass_name="fuse_hard_swish",
    namespace="generic",
    run_after="common::fuse_leaky_relu",
    name="hard_swish",
)
