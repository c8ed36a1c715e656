"""``mil_backend::fuse_activation_silu``: ``x * sigmoid(x)`` into one ``silu`` op.

Math: ``silu(x) = x * sigmoid(x)`` by definition. Commutativity of ``mul`` is handled by the matcher, so
``sigmoid(x) * x`` is the same pattern::

    x --> sigmoid --> mul --> y
    |                  ^
    |------------------|

    becomes:

    x --> silu --> y

As in coremltools, the ``silu`` is inserted before the ``sigmoid`` and takes the name of the output it
replaces; the ``sigmoid`` must have no other consumer and not be a block output (the matcher's rule for
intermediates). Nothing else is checked, so there is no ``var_constraints``.
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, register_generic_pass

__all__ = ["silu_pattern", "transform_silu"]

_SHAPE = [get_new_symbol(), get_new_symbol(), get_new_symbol()]


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def silu_pattern(x):
    sigmoid = mb.sigmoid(x=x, name="sigmoid")
    return mb.mul(x=x, y=sigmoid, name="mul")


def transform_silu(pattern: Pattern) -> None:
    """Inserts ``silu`` before the ``sigmoid`` and redirects the output to it."""
    silu = mb.silu(x=pattern.root_var, name=pattern.mul.outputs[0].name, before_op=pattern.sigmoid)
    pattern.replace_output(silu)


register_generic_pass(
    ops_arrangement=silu_pattern,
    var_constraints=None,
    transform_pattern=transform_silu,
    pass_name="fuse_activation_silu",
    namespace="mil_backend",
    name="silu",
)
