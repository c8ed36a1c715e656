"""``generic::fuse_gelu_sigmoid_approximation``: quick GELU ``x * sigmoid(1.702 * x)`` into one ``gelu``.

Math: CLIP's "quick GELU" is ``x * sigmoid(1.702 * x)``. coremltools defines
``gelu(mode="SIGMOID_APPROXIMATION")`` as exactly ``x * sigmoid(1.702 * x)`` (its docstring and its
``value_inference``), so the fusion is exact, not an approximation of an approximation. coremltools 9.0
has no pass for it: converted CLIP models keep ``mul -> sigmoid -> mul``.

Converted PyTorch (``x * torch.sigmoid(1.702 * x)``) reaches the pipeline as this chain; commutativity of
``mul`` is handled by the matcher, so ``sigmoid(x * 1.702) * x`` is the same pattern::

    x --> mul(1.702) --> sigmoid --> mul --> y
    |                                 ^
    |---------------------------------|

    becomes:

    x --> gelu(mode="SIGMOID_APPROXIMATION") --> y

The constant is checked by the pattern with the tolerance coremltools uses for every GELU constant
(absolute 1e-3). ``gelu`` is inserted before the ``mul(1.702)`` (as ``fuse_gelu_exact`` inserts before
its first op) and takes the name of the output it replaces.

Pass ids (decision): the pattern is registered twice, with the same callbacks:

* ``generic::fuse_gelu_sigmoid_approximation``, a new pass that runs whenever a pipeline names it;
* ``common::fuse_gelu_exact``, the coremltools pass it extends. That pass is in coremltools' default
  pipeline, so under ``ENABLE_EXPERIMENTAL_PASSES=1`` ``coremltools.convert`` fuses quick GELU with no
  change to any pipeline; with the override off, coremltools' own ``fuse_gelu_exact`` runs, unchanged.
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, register_generic_pass

from ._gelu_common import GELU_CONSTANTS, keeps_shape_and_dtype, replace_with_gelu

__all__ = ["quick_gelu_pattern", "quick_gelu_constraints", "transform_quick_gelu"]

_SHAPE = [get_new_symbol(), get_new_symbol(), get_new_symbol()]


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def quick_gelu_pattern(x):
    scale = mb.mul(x=x, y=1.702, name="scale")
    sigmoid = mb.sigmoid(x=scale, name="sigmoid")
    return mb.mul(x=x, y=sigmoid, name="out")


def quick_gelu_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Declines a match whose output does not have the shape and dtype of ``x`` (broadcast constant)."""
    return keeps_shape_and_dtype(pattern, pattern.out) or (
        False,
        "the output does not have the shape and dtype of x (a constant broadcasts it)",
    )


def transform_quick_gelu(pattern: Pattern) -> None:
    """Inserts ``gelu(SIGMOID_APPROXIMATION)`` before the ``mul(1.702)`` and redirects the output."""
    replace_with_gelu(pattern, "SIGMOID_APPROXIMATION", out=pattern.out, before=pattern.scale)


for _namespace, _pass_name in (
    ("generic", "fuse_gelu_sigmoid_approximation"),
    ("common", "fuse_gelu_exact"),
):
    register_generic_pass(
        ops_arrangement=quick_gelu_pattern,
        var_constraints=quick_gelu_constraints,
        transform_pattern=transform_quick_gelu,
        pass_name=_pass_name,
        namespace=_namespace,
        constants=GELU_CONSTANTS,
        name="gelu_sigmoid",
    )
