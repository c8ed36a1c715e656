"""``generic::fold_rotate_half_sign``: the ``neg`` of rotary embeddings' ``rotate_half`` folded into sin.

Rotary embeddings (Llama, Mistral, Qwen2, Gemma, Phi-3, ...) compute ``q * cos + rotate_half(q) * sin``
with ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])``: seven MIL ops per tensor (two slices, a
``mul`` by -1, a ``concat``, two ``mul``, an ``add``). GPT-J, Cohere and other interleaved rotaries
write it ``stack(-x2, x1, dim=-1).flatten(-2)`` with ``x1 = x[..., ::2]``, ``x2 = x[..., 1::2]``: a
``stack`` and a ``reshape`` in place of the ``concat``. Either way the sign can live in the sin table::

    cat(-x2, x1) * sin              = cat(x2, x1) * (sin * s)         s = [-1] * len(x2) ++ [+1] * len(x1)
    flat(stack(-x2, x1, -1)) * sin  = flat(stack(x2, x1, -1)) * (sin * s)   s = [-1, +1, -1, +1, ...]

(``s`` along the concat axis, or the last axis; ``concat(interleave=True)`` is the stack form.)
Negation is exact in floating point, so the rewrite is exact. ::

    Concat form:                                   Stack form (GPT-J, Cohere):

    x2 --> mul(-1) --> concat(axis) --> mul(sin)   x2 --> mul(-1) --> stack(-1) --> reshape --> mul(sin)
    x1 ------------------^                         x1 ------------------^

become::

    x2, x1 --> concat(axis) --> mul(sin')          x2, x1 --> stack(-1) --> reshape --> mul(sin')

one op fewer per rotated tensor (two per attention layer), where ``sin'`` is:

* a constant ``sin``: the table with the sign in it (``sin * s`` computed at compile time);
* a ``sin`` computed at run time (positions that are inputs, as in a KV-cache decoder with flexible
  lengths): one ``mul(sin, s)``, inserted right after ``sin`` is computed and read by every rotation of
  that ``sin``. The table is shared by every layer, so one ``mul`` replaces one per rotated tensor; the
  pass makes it only when ``sin`` has at least two rotations to fold (fewer ops), and reuses it for the
  others::

      sin --> mul(cat_1) ...  mul(cat_2) ...

  becomes::

      sin --> mul(s) --> sin' --> mul(cat_1) ...  mul(cat_2) ...

Conditions: the ``-1`` is exactly -1, ``sin`` (not a constexpr) has the same dtype and its size along the
axis (aligned from the right) is the full size, so the sign has a place in it; the stack form stacks on
a new last axis that the ``reshape`` merges with the one before (the sizes proven from the program's
shape ops where they are symbolic, :mod:`generic_passes._shape_proof`).

Decision on the rest of rotary embeddings: ``rotate_half`` as one constant ``+-1`` permutation
``matmul`` would save three more ops per tensor, but it multiplies each head vector by a ``d x d``
matrix, ``d^2`` multiply-adds per head and token where the slices cost nothing: compute that grows with
the head size squared, for ops that are copies. Not done. ``x * cos + r * sin`` has no smaller exact MIL
form (no fused multiply-add op). So rotary costs 6 ops per tensor after this pass.

Runs right after ``common::fuse_layernorm_or_instancenorm`` with the override on (constants folded).
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Block, Function, Operation, Program, Var
from numpy.typing import DTypeLike

from generic_passes._shape_proof import ShapeFacts
from pattern_infra import ConstRule, Pattern, predicates, register_generic_pass

__all__ = [
    "FORMS",
    "fold_rotate_half_sign_constraints",
    "rotate_half_pattern",
    "transform_fold_rotate_half_sign",
]

FORMS: tuple[str, ...] = ("concat", "stack")
"""``cat(-x2, x1)`` (``transformers``' ``rotate_half``) or ``stack(-x2, x1, -1)`` + ``reshape`` (GPT-J)."""

MIN_SHARED_FOLDS = 2
"""A run-time ``sin`` gets its own ``mul`` by the sign only when at least this many rotations read it."""


def rotate_half_pattern(form: str) -> Program:
    """The pattern of one form (:data:`FORMS`): ops ``neg``, ``cat`` (concat) or ``stacked`` and ``flat``
    (stack), ``mul_sin``."""

    def body(x2: Var, x1: Var, sin: Var) -> Var:
        neg = mb.mul(x=x2, y=-1.0, name="neg")
        if form == "concat":
            rotated = mb.concat(values=[neg, x1], axis=-1, name="cat")
        else:
            rotated = mb.reshape(
                x=mb.stack(values=[neg, x1], axis=-1, name="stacked"), shape=[1, 2, 3, 8], name="flat"
            )
        return mb.mul(x=rotated, y=sin, name="mul_sin")

    specs = [
        mb.TensorSpec(shape=(1, 2, 3, 4)),
        mb.TensorSpec(shape=(1, 2, 3, 4)),
        mb.TensorSpec(shape=(1, 1, 3, 8)),
    ]
    return mb.program(input_specs=specs)(lambda x2, x1, sin: body(x2, x1, sin))


def _sin(pattern: Pattern) -> Var:
    return pattern.operand("mul_sin", "y")


def _rotated(pattern: Pattern) -> Var:
    return (pattern.cat if "cat" in pattern.ops else pattern.flat).outputs[0]


def _sign(pattern: Pattern) -> tuple[int, np.ndarray] | None:
    """(axis of the rotated tensor the sign runs along, the signs) when the form is one of the above."""
    facts = ShapeFacts.of(pattern.block)
    x2 = pattern.operand("neg", "x")
    out = facts.dims(_rotated(pattern))
    if out is None or facts.dims(pattern.neg.outputs[0]) != facts.dims(x2):
        return None
    if "cat" in pattern.ops:
        cat = pattern.cat
        axis = int(cat.axis.val) % len(out)
        n2, n1 = facts.dim(x2, axis), facts.dim(cat.values[1], axis)
        if not (n2.is_Integer and n1.is_Integer):
            return None
        if bool(cat.interleave.val):
            return None if n1 != n2 else (axis, np.tile(np.array([-1, 1]), int(n2)))
        return axis, np.concatenate([-np.ones(int(n2)), np.ones(int(n1))])
    stacked = pattern.stacked
    inner = facts.dims(stacked.outputs[0])
    if inner is None or int(stacked.axis.val) % len(inner) != len(inner) - 1 or len(out) != len(inner) - 1:
        return None
    if not inner[-2].is_Integer or not facts.same_dims(out[:-1], inner[:-2]) or out[-1] != 2 * inner[-2]:
        return None
    return len(out) - 1, np.tile(np.array([-1, 1]), int(inner[-2]))


def fold_rotate_half_sign_constraints(pattern: Pattern) -> bool | str:
    """-1 exactly, one of the forms, sin of the same dtype spanning the axis; a run-time sin shared."""
    if np.asarray(pattern.operand("neg", "y").val).size != 1:
        return "the -1 is not a one-element constant"
    sign = _sign(pattern)
    if sign is None:
        return "not one of the rotate_half forms"
    axis, signs = sign
    sin, out = _sin(pattern), _rotated(pattern)
    if sin.shape is None or predicates.is_constexpr(sin) or sin.dtype != out.dtype:
        return "sin of unknown shape, a constexpr, or of another dtype than the rotation"
    from_right = out.rank - axis
    if sin.rank == 0 or sin.rank > out.rank or from_right > sin.rank:
        return f"sin of rank {sin.rank} does not reach the rotated axis {axis}"
    if ShapeFacts.of(pattern.block).dim(sin, sin.rank - from_right) != len(signs):
        return "sin does not span the rotated axis"
    if not predicates.is_constant(sin):
        if _signed_sin(sin, signs, from_right, pattern.block) is None and _rotations(sin) < MIN_SHARED_FOLDS:
            return "run-time sin read by one rotation only"
        if not _in_block(sin, pattern.block):
            return "run-time sin computed in another block"
    pattern.add_attribute("signs", signs)
    pattern.add_attribute("from_right", from_right)
    return True


def _in_block(var: Var, block: Block) -> bool:
    if var.op is not None:
        return var.op.enclosing_block is block
    return isinstance(block, Function) and any(var is v for v in block.inputs.values())


def _rotations(sin: Var) -> int:
    """How many ``mul`` read ``sin`` times a rotate_half with its ``mul`` by -1 (either form)."""
    count = 0
    for op in sin.child_ops:
        if op.op_type != "mul":
            continue
        other = op.x if op.y is sin else op.y
        source = other.op
        if source is not None and source.op_type == "reshape" and source.x.op is not None:
            source = source.x.op if source.x.op.op_type == "stack" else None
        if source is None or source.op_type not in ("concat", "stack"):
            continue
        first = source.values[0].op
        if (
            first is not None
            and first.op_type == "mul"
            and any(
                v.val is not None
                and np.asarray(v.val).size == 1
                and float(np.asarray(v.val).reshape(())) == -1.0
                for v in (first.x, first.y)
            )
        ):
            count += 1
    return count


def _sign_table(signs: np.ndarray, from_right: int, dtype: DTypeLike) -> np.ndarray:
    return signs.reshape((-1,) + (1,) * (from_right - 1)).astype(dtype)


def _signed_sin(sin: Var, signs: np.ndarray, from_right: int, block: Block) -> Var | None:
    """An existing ``mul(sin, s)`` with the same signs made by this pass for an earlier rotation."""
    table = _sign_table(signs, from_right, np.float64)
    for op in sin.child_ops:
        if op.op_type == "mul" and op.x is sin and op.enclosing_block is block and op.y.val is not None:
            value = np.asarray(op.y.val)
            if value.shape == table.shape and np.array_equal(value, table):
                return op.outputs[0]
    return None


def _after(var: Var, block: Block) -> Operation:
    """The op before which an op computed from ``var`` goes so that it precedes every use of ``var``."""
    if var.op is None:
        return block.operations[0]
    ops = block.operations
    if isinstance(ops, list):
        return ops[ops.index(var.op) + 1]
    return ops.op_to_node[var.op].next.op  # coremltools' linked list of ops: O(1)


def transform_fold_rotate_half_sign(pattern: Pattern) -> None:
    """The rotation without the ``mul`` by -1, times ``sin`` with the sign in it."""
    last = pattern.mul_sin
    sin, signs, from_right = _sin(pattern), pattern.signs, pattern.from_right
    x2, x1 = pattern.operand("neg", "x"), (pattern.cat if "cat" in pattern.ops else pattern.stacked).values[1]
    dtype = np.float16 if predicates.dtype_is(sin, "fp16") else np.float32
    if predicates.is_constant(sin):
        signed: Var | np.ndarray = np.asarray(sin.val) * _sign_table(
            signs, from_right, np.asarray(sin.val).dtype
        )
    else:
        signed = _signed_sin(sin, signs, from_right, pattern.block)
        if signed is None:
            signed = mb.mul(
                x=sin,
                y=_sign_table(signs, from_right, dtype),
                name=f"{sin.name}_signed",
                before_op=_after(sin, pattern.block),
            )
    if "cat" in pattern.ops:
        cat = pattern.cat
        rotated = mb.concat(
            values=[x2, x1],
            axis=cat.axis,
            interleave=cat.interleave,
            name=cat.outputs[0].name,
            before_op=last,
        )
    else:
        stacked = mb.stack(
            values=[x2, x1], axis=pattern.stacked.axis, name=pattern.stacked.outputs[0].name, before_op=last
        )
        rotated = mb.reshape(
            x=stacked, shape=pattern.flat.shape, name=pattern.flat.outputs[0].name, before_op=last
        )
    out = mb.mul(x=rotated, y=signed, name=last.outputs[0].name, before_op=last)
    pattern.replace_output(out)


for _form in FORMS:
    register_generic_pass(
        ops_arrangement=rotate_half_pattern(_form),
        var_constraints=fold_rotate_half_sign_constraints,
        transform_pattern=transform_fold_rotate_half_sign,
        pass_name="fold_rotate_half_sign",
        namespace="generic",
        const_rules={
            "neg.y": ConstRule("value", rtol=0.0, atol=0.0),
            **(
                {"cat.axis": "const", "cat.interleave": "const"}
                if _form == "concat"
                else {"stacked.axis": "const"}
            ),
        },
        name="rotate_half_sign" if _form == "concat" else "rotate_half_sign[stack]",
        run_after="common::fuse_layernorm_or_instancenorm",
    )
