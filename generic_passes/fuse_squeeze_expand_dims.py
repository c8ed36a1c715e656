"""``common::fuse_squeeze_expand_dims``: a ``squeeze`` undone by an ``expand_dims`` into an ``identity``.

Math: ``squeeze`` only removes size-1 dimensions and ``expand_dims`` only inserts them; neither moves an
element in row-major order. So when ``expand_dims(squeeze(x))`` has ``x``'s shape it *is* ``x``::

        x[3, 1, 4, 1] --> squeeze(axes=[1, 3]) --> [3, 4] --> expand_dims(axes=[1, 3]) --> y[3, 1, 4, 1]

    becomes:

        x[3, 1, 4, 1] --> identity --> y[3, 1, 4, 1]

(``noop_elimination`` later removes the ``identity``.) As in coremltools the ``identity`` is inserted
before the ``squeeze`` with the builder's automatic name (``identity_<n>``), shapes are compared exactly
(symbolic dimensions by symbol), and the ``squeeze`` output must feed only the ``expand_dims`` and not be
a block output (the ``expand_dims`` output may be one). Where ``expand_dims``'s output cannot take the
``identity``'s place (a ``constexpr`` upstream of it that ``x`` does not have), the match is declined
before anything is inserted; coremltools inserts the ``identity`` first and leaves it dangling.
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, register_generic_pass

__all__ = ["squeeze_expand_dims", "transform_squeeze_expand_dims"]

_RANK4 = [get_new_symbol(), 1, get_new_symbol(), 1]


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def squeeze_expand_dims(x):
    # No axes on the pattern's squeeze: the slot is optional, so a squeeze with or without axes matches.
    squeezed = mb.squeeze(x=x, name="squeeze")
    return mb.expand_dims(x=squeezed, axes=[1, 3], name="expand_dims")


def _constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    x = pattern.root_var
    out = pattern.expand_dims.outputs[0]
    if x.shape is None or out.shape is None or tuple(x.shape) != tuple(out.shape):
        return False, f"expand_dims gives shape {out.shape}, not x's {x.shape}"
    if not out.nonreplaceable_vars_upstream.issubset(x.nonreplaceable_vars_upstream):
        return False, "the output cannot be replaced by x (a non-replaceable var upstream)"
    return True


def transform_squeeze_expand_dims(pattern: Pattern) -> None:
    """Inserts ``identity(x)`` before the ``squeeze`` and gives it the ``expand_dims``'s users."""
    identity = mb.identity(x=pattern.root_var, before_op=pattern.squeeze)
    pattern.replace_output(identity)


register_generic_pass(
    ops_arrangement=squeeze_expand_dims,
    var_constraints=_constraints,
    transform_pattern=transform_squeeze_expand_dims,
    pass_name="fuse_squeeze_expand_dims",
    namespace="common",
    name="squeeze_expand_dims",
)
