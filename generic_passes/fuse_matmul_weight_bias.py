"""``common::fuse_matmul_weight_bias``: ``matmul`` by a constant matrix, plus a constant, into ``linear``.

Math: ``linear(x, W, b) = x @ W.T + b``, with ``b`` added along the last axis. With ``Wm`` the constant
matrix as the ``matmul`` uses it (``W``, or ``W.T`` under ``transpose_*``)::

    weight on the right:   x @ Wm + c   =  linear(x, Wm.T, c)              c varies along the last axis
    weight on the left:    Wm @ y + c   =  transpose(linear(y.T, Wm, c))    c varies along axis -2
    and for ``sub``:       x @ Wm - c   =  linear(x, Wm.T, -c)
                           c - x @ Wm   =  linear(x, -Wm.T, c)              (and likewise on the left)

One registration covers ``add`` and ``sub`` in either operand order (alternatives, and the matcher's
commutativity), and the weight on either side of the ``matmul`` (two pattern inputs; the constant one is
the weight, the left one when both are)::

    x --> matmul --> add_or_sub(c) --> out      x or y: a constant of rank 2 with no other user
    y -----^                                    c: a constant

    becomes, weight on the right (y):

    x --> [transpose, if transpose_x] --> linear(Wm.T, c') --> out

    and weight on the left (x):

    y --> [transpose, unless transpose_y] --> linear(Wm, c') --> transpose --> out

The ops are the ones coremltools inserts, in its order (``transpose`` ops on the weight, which later
passes fold into a constant), before the ``matmul``; the op producing the output takes its name.

A compressed weight (``constexpr_*`` ops, e.g. palettized or int8) is a weight too, used as it is where
the ``linear`` takes it untransposed (on the right with ``transpose_y``, on the left without
``transpose_x``); a ``c - matmul`` negates it in its constexpr ops (scale or LUT, or a new
``constexpr_blockwise_shift_scale`` at iOS18), never decompressed. Elsewhere the match is refused with
the reason (the ``linear`` would need a transpose of the weight at run time). coremltools leaves such a
``matmul`` alone.

Refusals kept from coremltools: no constant side; a weight that is not rank 2; a weight with several
users (the fused weight would be a copy); an input of rank < 2; ``c`` that is not ``Dout`` values laid
out as ``(1, ..., 1, Dout)``.

Where coremltools 9.0 is wrong, this pass differs (each case has a test):

* ``c - matmul``: coremltools negates ``c`` whatever the side, which computes ``matmul - c``. Here the
  weight is negated instead (it is then passed as a fresh constant).
* weight on the left: coremltools adds ``c`` along the wrong axis (the output's last one, while the
  ``linear`` bias lands on axis -2 after the final transpose). Here ``c`` must vary along axis -2:
  ``(..., 1, M, 1)`` with ``M`` the ``matmul``'s output rows.
* ``c`` with more dimensions than the ``matmul`` output (it broadcasts the output to a higher rank):
  coremltools fuses and the output loses dimensions; refused here.
* the ``matmul`` output also a block output: coremltools inserts the ``linear`` and then raises
  ``ValueError`` removing the ``matmul``; refused here (the matcher's rule for intermediates).
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var, get_new_symbol

from pattern_infra import Pattern, register_generic_pass

from ._compressed import compressed_by, is_compressed, scale_compressed, scale_refusal

__all__ = ["matmul_bias_pattern", "matmul_bias_constraints", "transform_matmul_bias"]


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), 3)), mb.TensorSpec(shape=(3, 4))])
def matmul_bias_pattern(x, y):
    matmul = mb.matmul(x=x, y=y, name="matmul")
    return mb.add(x=matmul, y=np.zeros(4, dtype=np.float32), name="add_or_sub")


def _is_weight(var: Var) -> bool:
    return var.val is not None or is_compressed(var)


def _roles(pattern: Pattern) -> tuple[bool, Var, Var, bool, bool]:
    """(weight on the left?, weight, other input, transpose the weight?, transpose the other?)."""
    mm = pattern.matmul
    if _is_weight(mm.x):
        return True, mm.x, mm.y, bool(mm.transpose_x.val), bool(mm.transpose_y.val)
    return False, mm.y, mm.x, bool(mm.transpose_y.val), bool(mm.transpose_x.val)


def _bias_vector(pattern: Pattern) -> np.ndarray | None:
    """``c`` as the ``linear`` bias (a vector of ``Dout`` values), or None if it cannot be one."""
    weight_left, weight, _, transpose_weight, _ = _roles(pattern)
    bias = np.asarray(pattern.operand("add_or_sub", "y").val)
    if bias.ndim > pattern.matmul.outputs[0].rank:
        return None  # c broadcasts the output to a higher rank
    if weight_left:
        # Wm @ y has Wm's rows on axis -2: c must be (..., 1, M, 1)
        d_out = weight.shape[1] if transpose_weight else weight.shape[0]
        if bias.ndim < 2 or bias.shape[-1] != 1 or bias.shape[-2] != d_out:
            return None
        if any(d != 1 for d in bias.shape[:-2]):
            return None
        return bias.reshape(d_out)
    d_out = weight.shape[0] if transpose_weight else weight.shape[1]
    if bias.ndim > 1:
        if any(d != 1 for d in bias.shape[:-1]):
            return None
        bias = np.squeeze(bias)
    if bias.ndim != 1 or bias.shape[0] != d_out:
        return None
    return bias


def _negates_weight(pattern: Pattern) -> bool:
    """Whether the fusion negates the weight (``c - matmul``)."""
    add_or_sub = pattern.add_or_sub
    return add_or_sub.op_type == "sub" and add_or_sub.x is not pattern.matmul.outputs[0]


def matmul_bias_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """One constant (or compressed) rank-2 weight with no other user, an input of rank >= 2, a
    bias-shaped ``c``."""
    mm = pattern.matmul
    if not (_is_weight(mm.x) or _is_weight(mm.y)):
        return False, "neither matmul input is a constant or a compressed weight"
    weight_left, weight, other, transpose_weight, _ = _roles(pattern)
    if weight.val is not None and weight.nonreplaceable_vars_upstream:
        return False, f"the weight {weight.name} derives from a constexpr op"
    if other.rank < 2 or weight.rank != 2:
        return False, "the weight is not of rank 2 or the other input is of rank < 2"
    if len(weight.child_ops) > 1:
        return False, f"the weight {weight.name} has other users"
    if _bias_vector(pattern) is None:
        return False, "c is not one value per output feature"
    if weight.val is None:
        if transpose_weight == weight_left:
            return False, (
                f"weight compressed by {compressed_by(weight)}: the linear would need it transposed "
                "at run time"
            )
        if _negates_weight(pattern) and (reason := scale_refusal(weight, (1, 1), mm)) is not None:
            return False, reason
    return True


def _swap_last_two(var: Var, name: str | None = None, before_op=None) -> Var:
    perm = list(range(var.rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    if name is None:
        return mb.transpose(x=var, perm=perm, before_op=before_op)
    return mb.transpose(x=var, perm=perm, name=name, before_op=before_op)


def transform_matmul_bias(pattern: Pattern) -> None:
    """Inserts the ``linear`` (and transposes) before the ``matmul``; the framework removes the old ops."""
    mm, add_or_sub = pattern.matmul, pattern.add_or_sub
    weight_left, weight, other, transpose_weight, transpose_other = _roles(pattern)
    bias = _bias_vector(pattern)
    assert bias is not None, "matmul_bias_constraints refused a bias that is not a vector"
    negate_weight = False
    if add_or_sub.op_type == "sub":
        if add_or_sub.x is mm.outputs[0]:  # matmul - c
            bias = -bias
        else:  # c - matmul
            negate_weight = True
    out_name = add_or_sub.outputs[0].name

    if weight.val is None:  # compressed, in the orientation the linear takes (constraints)
        w = scale_compressed(weight, np.full((1, 1), -1.0), before_op=mm) if negate_weight else weight
        if weight_left:
            x = other if transpose_other else _swap_last_two(other, before_op=mm)
            fused = mb.linear(x=x, weight=w, bias=bias, before_op=mm)
            fused = _swap_last_two(fused, name=out_name, before_op=mm)
        else:
            x = _swap_last_two(other, before_op=mm) if transpose_other else other
            fused = mb.linear(x=x, weight=w, bias=bias, name=out_name, before_op=mm)
        pattern.replace_output(fused, force=True)  # a negated weight's new constexpr ops replace the old
        return
    if weight_left:
        # Wm @ y = transpose(linear(transpose(y), Wm))
        x = other if transpose_other else _swap_last_two(other, before_op=mm)
        if negate_weight:
            w = -(weight.val.T if transpose_weight else weight.val)
        else:
            w = _swap_last_two(weight, before_op=mm) if transpose_weight else weight
        fused = mb.linear(x=x, weight=w, bias=bias, before_op=mm)
        fused = _swap_last_two(fused, name=out_name, before_op=mm)
    else:
        # x @ Wm = linear(x, Wm.T)
        x = _swap_last_two(other, before_op=mm) if transpose_other else other
        if negate_weight:
            w = -(weight.val if transpose_weight else weight.val.T)
        else:
            w = weight if transpose_weight else _swap_last_two(weight, before_op=mm)
        fused = mb.linear(x=x, weight=w, bias=bias, name=out_name, before_op=mm)
    pattern.replace_output(fused)


register_generic_pass(
    ops_arrangement=matmul_bias_pattern,
    var_constraints=matmul_bias_constraints,
    transform_pattern=transform_matmul_bias,
    pass_name="fuse_matmul_weight_bias",
    namespace="common",
    alternatives={"add_or_sub": ["add", "sub"]},
    commutative=["add_or_sub"],  # sub too: the transform reads which side the op is on
    const_rules={"add_or_sub.y": "const"},
    name="matmul_bias",
)
