"""``generic::fold_rotate_half_sign``: the ``neg`` of rotary embeddings' ``rotate_half`` folded into sin.

Rotary embeddings (Llama, Mistral, Qwen2, Gemma, Phi-3, ...) compute ``q * cos + rotate_half(q) * sin``
with ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])``: seven MIL ops per tensor (two slices, a
``mul`` by -1, a ``concat``, two ``mul``, an ``add``). When ``sin`` is a constant table (positions known
at conversion: ``transformers`` computes it from ``arange``), the sign can live in the table::

    cat(-x2, x1) * sin = cat(x2, x1) * (sin * s)      s = [-1] * len(x2) ++ [+1] * len(x1)  (concat axis)

Negation is exact in floating point, so the rewrite is exact. ::

    x2 --> mul(-1) --> concat(axis) --> mul(sin) --> y
    x1 ------------------^

becomes::

    x2, x1 --> concat(axis) --> mul(sin * s) --> y

one op fewer per rotated tensor (two per attention layer). Conditions: the ``-1`` is exactly -1, the
concat does not interleave, ``sin`` is a constant (not a constexpr) of the same dtype whose size along
the concat axis (aligned from the right) is the concat's full size, so the sign has a place in it.

Decision on the rest of rotary embeddings (issue 16): ``rotate_half`` as one constant ``+-1``
permutation ``matmul`` would save three more ops per tensor, but it multiplies each head vector by a
``d x d`` matrix, ``d^2`` multiply-adds per head and token where the slices cost nothing: compute that
grows with the head size squared, for ops that are copies. Not done. ``x * cos + r * sin`` has no
smaller exact MIL form (no fused multiply-add op). So rotary costs 6 ops per tensor after this pass.

Runs right after ``common::fuse_layernorm_or_instancenorm`` with the override on (constants folded).
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var

from pattern_infra import ConstRule, Pattern, predicates, register_generic_pass

__all__ = ["fold_rotate_half_sign_constraints", "rotate_half_pattern", "transform_fold_rotate_half_sign"]


@mb.program(input_specs=[mb.TensorSpec(shape=(1, 2, 3, 4)), mb.TensorSpec(shape=(1, 2, 3, 4)),
                         mb.TensorSpec(shape=(1, 1, 3, 8))])
def rotate_half_pattern(x2, x1, sin):
    neg = mb.mul(x=x2, y=-1.0, name="neg")
    cat = mb.concat(values=[neg, x1], axis=-1, name="cat")
    return mb.mul(x=cat, y=sin, name="mul_sin")


def _sin(pattern: Pattern) -> Var:
    return pattern.operand("mul_sin", "y")


def fold_rotate_half_sign_constraints(pattern: Pattern) -> bool:
    """-1 exactly, plain concat, constant sin of the same dtype spanning the concat axis."""
    neg, cat = pattern.neg, pattern.cat
    if np.asarray(pattern.operand("neg", "y").val).size != 1 or bool(cat.interleave.val):
        return False
    x2, sin = pattern.operand("neg", "x"), _sin(pattern)
    out = cat.outputs[0]
    if out.shape is None or sin.shape is None or x2.shape is None or neg.outputs[0].shape != x2.shape:
        return False
    if not predicates.is_constant(sin) or predicates.is_constexpr(sin) or sin.dtype != out.dtype:
        return False
    if sin.rank > out.rank or sin.rank == 0:
        return False
    axis = int(cat.axis.val) % out.rank
    from_right = out.rank - axis
    if from_right > sin.rank or sin.shape[-from_right] != out.shape[axis]:
        return False
    if not isinstance(x2.shape[axis], (int, np.integer)):
        return False
    pattern.add_attribute("sign_axis", sin.rank - from_right)
    pattern.add_attribute("negated", int(x2.shape[axis]))
    return True


def transform_fold_rotate_half_sign(pattern: Pattern) -> None:
    """``concat(x2, x1) * (sin with its first ``len(x2)`` entries along the axis negated)``."""
    cat, last = pattern.cat, pattern.mul_sin
    table = np.array(_sin(pattern).val, copy=True)
    index = [slice(None)] * table.ndim
    index[pattern.sign_axis] = slice(0, pattern.negated)
    table[tuple(index)] = -table[tuple(index)]
    values = [pattern.operand("neg", "x"), cat.values[1]]
    new_cat = mb.concat(values=values, axis=cat.axis, interleave=False, name=cat.outputs[0].name, before_op=last)
    out = mb.mul(x=new_cat, y=table, name=last.outputs[0].name, before_op=last)
    pattern.replace_output(out)


register_generic_pass(
    ops_arrangement=rotate_half_pattern,
    var_constraints=fold_rotate_half_sign_constraints,
    transform_pattern=transform_fold_rotate_half_sign,
    pass_name="fold_rotate_half_sign",
    namespace="generic",
    const_rules={"neg.y": ConstRule("value", rtol=0.0, atol=0.0), "cat.axis": "const",
                 "cat.interleave": "const"},
    name="rotate_half_sign",
    run_after="common::fuse_layernorm_or_instancenorm",
)
