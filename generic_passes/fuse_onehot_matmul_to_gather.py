"""``common::fuse_onehot_matmul_to_gather``: ``one_hot`` times a constant matrix is a row lookup.

Math: with ``on_value = 1``, ``off_value = 0`` and the one-hot axis last, ``one_hot(i, N)`` is row ``i``
of the identity, so ``one_hot(i, N) @ W = W[i]``, i.e. ``gather(W, i, axis=0)`` (rank-2 ``W``, no
transposes). Indices are taken to be in ``[0, N)``, as coremltools does (the ``one_hot`` of an index
outside is a row of zeros, which no ``gather`` reproduces). From iOS17 on ``gather`` requires
non-negative indices, so coremltools first wraps them, ``i < 0 ? i + W.shape[0] : i`` (the negative-index
rule ``gather`` had before); the same ops are inserted here::

    i --> one_hot(N, axis=-1, on=1, off=0) --> matmul(y=W) --> out        W: a rank-2 constant

    becomes, before iOS17:

    i --> gather(W, axis=0) --> out

    and from iOS17 on:

    i --> greater_equal(0) ----------------------------------> select --> gather(W, axis=0) --> out
    |                                                            ^  ^
    |------------------------------------------------------------|  |
    |--> add( slice_by_index(shape(W), [0]) ) ----------------------|

The ops are coremltools', in its order (all unnamed but the ``gather``, which takes the output's name),
inserted before the ``matmul``. ``on_value`` and ``off_value`` are compared with coremltools' absolute
tolerance of 1e-3.

Refusals kept from coremltools: the values and axis above, a non-constant ``one_hot_vector_size`` or
``W``, ``W`` not of rank 2, ``transpose_x`` / ``transpose_y`` set, the ``one_hot`` on the ``y`` side.
One difference: coremltools normalizes a non-negative ``axis`` with the rank of the *indices* instead of
the rank of the output, so it fuses ``axis = rank(i) - 1`` (the one-hot axis is then second to last:
wrong) and refuses ``axis = rank(i)`` (the last axis: right). Here the output rank is used.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil._deployment_compatibility import AvailableTarget
from coremltools.converters.mil.mil import get_new_symbol, types
from coremltools.converters.mil.mil.block import is_current_opset_version_compatible_with

from pattern_infra import ConstRule, Pattern, predicates, register_generic_pass

__all__ = ["onehot_matmul_pattern", "onehot_matmul_constraints", "transform_onehot_matmul"]

_N, _D = 4, 3


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(),), dtype=types.int32)])
def onehot_matmul_pattern(x):
    one_hot = mb.one_hot(
        indices=x, one_hot_vector_size=_N, axis=-1, on_value=1.0, off_value=0.0, name="one_hot"
    )
    return mb.matmul(x=one_hot, y=np.zeros((_N, _D), dtype=np.float32), name="matmul")


def onehot_matmul_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """The one-hot axis is the last; no transposes; ``W`` has rank 2.

    Returns:
        True, or ``(False, reason)``.
    """
    one_hot, matmul = pattern.one_hot, pattern.matmul
    axis = int(one_hot.axis.val)
    rank = one_hot.outputs[0].rank
    if axis < 0:
        axis += rank
    if axis != rank - 1:
        return False, f"the one-hot axis is {axis}, not the last ({rank - 1})"
    if not (
        predicates.attr_is(matmul, "transpose_x", False) and predicates.attr_is(matmul, "transpose_y", False)
    ):
        return False, "the matmul transposes an operand"
    if matmul.y.rank != 2:
        return False, f"the matrix has rank {matmul.y.rank}, not 2"
    return True


def transform_onehot_matmul(pattern: Pattern) -> None:
    """Inserts the ``gather`` (with the index wrap from iOS17) before the ``matmul``."""
    matmul = pattern.matmul
    indices, weight = pattern.root_var, matmul.y
    if is_current_opset_version_compatible_with(AvailableTarget.iOS17):
        non_negative = mb.greater_equal(x=indices, y=0, before_op=matmul)
        rows = mb.shape(x=weight, before_op=matmul)
        rows = mb.slice_by_index(x=rows, begin=[0], end=[0], squeeze_mask=[True], before_op=matmul)
        wrapped = mb.add(x=indices, y=rows, before_op=matmul)
        indices = mb.select(cond=non_negative, a=indices, b=wrapped, before_op=matmul)
    gather = mb.gather(x=weight, indices=indices, axis=0, name=matmul.outputs[0].name, before_op=matmul)
    pattern.replace_output(gather)


_ONE = ConstRule("value", rtol=0.0, atol=1e-3)

register_generic_pass(
    ops_arrangement=onehot_matmul_pattern,
    var_constraints=onehot_matmul_constraints,
    transform_pattern=transform_onehot_matmul,
    pass_name="fuse_onehot_matmul_to_gather",
    namespace="common",
    const_rules={
        "one_hot.one_hot_vector_size": "const",
        "one_hot.axis": "const",
        "one_hot.on_value": _ONE,
        "one_hot.off_value": _ONE,
        "matmul.y": "const",
    },
    name="onehot_matmul",
)
