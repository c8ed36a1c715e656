"""``common::prelu_to_lrelu``: a ``prelu`` whose ``alpha`` is the same on every channel into ``leaky_relu``.

Math: ``prelu(x, alpha)`` is ``x`` where ``x >= 0`` and ``alpha[c] * x`` where ``x < 0``, ``c`` being the
channel. When every ``alpha[c]`` equals ``alpha[0]`` that is ``leaky_relu(x, alpha[0])``::

    x --> prelu(alpha=[a, a, ..., a]) --> y

    becomes:

    x --> leaky_relu(alpha=a) --> y

As in coremltools, the values must be exactly equal (no tolerance), ``alpha[0]`` becomes the scalar
``alpha`` of ``leaky_relu`` (same dtype), and the ``leaky_relu`` is inserted before the ``prelu`` and
takes the name of its output. ``alpha`` must be a compile-time constant (``const_rules``);
``var_constraints`` checks that its values are all equal.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, register_generic_pass

__all__ = ["prelu_pattern", "common_leakage_factor", "transform_prelu_to_lrelu"]

_SHAPE = [get_new_symbol(), 2, get_new_symbol(), get_new_symbol()]


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def prelu_pattern(x):
    return mb.prelu(x=x, alpha=np.array([0.25, 0.25], dtype=np.float32), name="prelu")


def common_leakage_factor(pattern: Pattern) -> bool | tuple[bool, str]:
    """Every channel has the same ``alpha``."""
    alpha = pattern.consts["prelu.alpha"].val
    return bool(np.all(alpha == alpha[0])) or (False, "the channels' alphas differ")


def transform_prelu_to_lrelu(pattern: Pattern) -> None:
    """Inserts ``leaky_relu(alpha[0])`` before the ``prelu`` and redirects the output to it."""
    lrelu = mb.leaky_relu(
        x=pattern.root_var,
        alpha=pattern.consts["prelu.alpha"].val[0],
        name=pattern.prelu.outputs[0].name,
        before_op=pattern.prelu,
    )
    pattern.replace_output(lrelu)


register_generic_pass(
    ops_arrangement=prelu_pattern,
    var_constraints=common_leakage_factor,
    transform_pattern=transform_prelu_to_lrelu,
    pass_name="prelu_to_lrelu",
    namespace="common",
    const_rules={"prelu.alpha": "const"},
    name="prelu_to_lrelu",
)
