"""What the three GELU fusions share: the constant rule, the shape check and the rewrite into ``gelu``.

``fuse_gelu_exact``, ``fuse_gelu_sigmoid_approximation`` and ``fuse_gelu_tanh_approximation`` differ in
their patterns and in the ``gelu`` mode they produce; each replaces its match the same way::

    x --> ... pattern ... --> y        becomes        x --> gelu(mode) --> y

with ``gelu`` inserted before a chosen op of the match and named after ``y``. Not a pass module (the
leading underscore keeps ``generic_passes`` from importing it as one).
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation

from pattern_infra import ConstRule, Pattern

__all__ = ["GELU_CONSTANTS", "keeps_shape_and_dtype", "replace_with_gelu"]

GELU_CONSTANTS = ConstRule("value", rtol=0.0, atol=1e-3)
"""Every constant of a GELU pattern, checked against its value with coremltools' tolerance (absolute 1e-3)."""


def keeps_shape_and_dtype(pattern: Pattern, out: Operation) -> bool:
    """Whether ``out``'s output has the shape and dtype of ``x`` (a broadcasting constant changes them,
    and ``gelu(x)`` would not)."""
    x, y = pattern.root_var, out.outputs[0]
    return x.dtype == y.dtype and x.shape == y.shape


def replace_with_gelu(pattern: Pattern, mode: str, *, out: Operation, before: Operation) -> None:
    """Inserts ``gelu(x, mode)`` before ``before``, named after ``out``'s output, and redirects that
    output to it; the framework removes the matched ops."""
    gelu = mb.gelu(
        x=pattern.root_var,
        mode=mode,
        name=out.outputs[0].name,
        before_op=before,
    )
    pattern.replace_output(gelu)
