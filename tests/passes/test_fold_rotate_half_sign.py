"""``generic::fold_rotate_half_sign``: rotate_half's ``mul(-1)`` folded into the constant sin table."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import op_types, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::fold_rotate_half_sign"
B, H, L, D = 1, 3, 5, 8
RNG = np.random.default_rng(11)
COS = RNG.standard_normal((1, 1, L, D)).astype(np.float32)
SIN = RNG.standard_normal((1, 1, L, D)).astype(np.float32)


def rotary(*, sin: np.ndarray | None = SIN, minus: float = -1.0, neg_first: bool = True) -> Program:
    """``q * cos + rotate_half(q) * sin`` as coremltools converts transformers' code; ``sin=None``: an
    input."""
    specs = [mb.TensorSpec(shape=(B, H, L, D))]
    if sin is None:
        specs.append(mb.TensorSpec(shape=(1, 1, L, D)))

    def body(q, s):
        x1 = mb.slice_by_index(x=q, begin=[0, 0, 0, 0], end=[B, H, L, D // 2])
        x2 = mb.slice_by_index(x=q, begin=[0, 0, 0, D // 2], end=[B, H, L, D])
        neg = mb.mul(x=x2, y=np.float32(minus))
        cat = mb.concat(values=[neg, x1] if neg_first else [x1, neg], axis=-1)
        return mb.add(x=mb.mul(x=q, y=COS), y=mb.mul(x=cat, y=s))

    if sin is None:
        return mb.program(input_specs=specs)(lambda q, s: body(q, s))
    return mb.program(input_specs=specs)(lambda q: body(q, sin))


def test_sign_folded_exactly():
    prog = rotary()
    ours = run_pass(PASS, prog)
    before, after = op_types(prog), op_types(ours)
    assert sorted(after) == sorted(before[:2] + before[3:]), after  # the mul(-1) gone, nothing else
    assert_programs_equivalent(prog, ours, rtol=0.0, atol=0.0)  # negation is exact
    (table,) = [
        op.y.val
        for op in ours.functions["main"].find_ops(op_type="mul")
        if op.x.op is not None and op.x.op.op_type == "concat"
    ]
    np.testing.assert_array_equal(table[..., : D // 2], -SIN[..., : D // 2])
    np.testing.assert_array_equal(table[..., D // 2 :], SIN[..., D // 2 :])


@pytest.mark.parametrize(
    "kwargs",
    [{"sin": None}, {"minus": -2.0}, {"neg_first": False}, {"sin": SIN[..., :1].copy()}],
    ids=["runtime_sin", "not_minus_one", "negated_half_second", "sin_broadcast_along_the_axis"],
)
def test_near_misses_left_alone(kwargs):
    prog = rotary(**kwargs)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)


# -- the stack form (GPT-J, Cohere): stack(-x2, x1, -1) + reshape -----------------------------------------


def interleaved(*, sin: np.ndarray | None = SIN, stack_axis: int = -1, concat: bool = False) -> Program:
    """``q * cos + flat(stack(-x[..., 1::2], x[..., ::2], -1)) * sin`` (or ``concat(interleave=True)``)."""
    specs = [mb.TensorSpec(shape=(B, H, L, D))]
    if sin is None:
        specs.append(mb.TensorSpec(shape=(1, 1, L, D)))

    def body(q, s):
        x1 = mb.slice_by_index(x=q, begin=[0, 0, 0, 0], end=[B, H, L, D], stride=[1, 1, 1, 2])
        x2 = mb.slice_by_index(x=q, begin=[0, 0, 0, 1], end=[B, H, L, D], stride=[1, 1, 1, 2])
        neg = mb.mul(x=x2, y=np.float32(-1.0))
        if concat:
            rotated = mb.concat(values=[neg, x1], axis=-1, interleave=True)
        else:
            stacked = mb.stack(values=[neg, x1], axis=stack_axis)
            rotated = mb.reshape(x=stacked, shape=[B, H, L, D])
        return mb.add(x=mb.mul(x=q, y=COS), y=mb.mul(x=rotated, y=s))

    if sin is None:
        return mb.program(input_specs=specs)(lambda q, s: body(q, s))
    return mb.program(input_specs=specs)(lambda q: body(q, sin))


@pytest.mark.parametrize("concat", [False, True], ids=["stack_reshape", "concat_interleave"])
def test_interleaved_sign_folded_exactly(concat):
    prog = interleaved(concat=concat)
    ours = run_pass(PASS, prog)
    before, after = op_types(prog), op_types(ours)
    assert after.count("mul") == before.count("mul") - 1 and len(after) == len(before) - 1, after
    assert_programs_equivalent(prog, ours, rtol=0.0, atol=0.0)
    (table,) = [
        op.y.val
        for op in ours.functions["main"].find_ops(op_type="mul")
        if op.y.val is not None and op.y.val.shape == SIN.shape and not np.array_equal(op.y.val, COS)
    ]
    np.testing.assert_array_equal(table[..., 0::2], -SIN[..., 0::2])
    np.testing.assert_array_equal(table[..., 1::2], SIN[..., 1::2])


def test_stack_on_another_axis_left_alone():
    """``stack(-x2, x1, axis=-2)`` + reshape puts all of ``-x2`` first: not the interleaved layout."""
    prog = interleaved(stack_axis=-2)
    assert op_types(run_pass(PASS, prog)) == op_types(prog)


# -- a sin computed at run time (positions from the inputs), shared by the rotations ---------------------


def runtime_sin(rotations: int = 2, *, form: str = "concat") -> Program:
    """``rotations`` tensors rotated with one ``sin`` computed from a positions input (as a KV-cache
    decoder with flexible lengths computes it once for every layer)."""
    specs = [mb.TensorSpec(shape=(B, H, L, D)), mb.TensorSpec(shape=(L, D))]

    @mb.program(input_specs=specs)
    def prog(q, angles):
        sin = mb.expand_dims(x=mb.sin(x=angles), axes=[0, 1], name="sin_table")
        outs = []
        for i in range(rotations):
            x = mb.mul(x=q, y=np.float32(i + 1))
            if form == "concat":
                x1 = mb.slice_by_index(x=x, begin=[0, 0, 0, 0], end=[B, H, L, D // 2])
                x2 = mb.slice_by_index(x=x, begin=[0, 0, 0, D // 2], end=[B, H, L, D])
                rotated = mb.concat(values=[mb.mul(x=x2, y=np.float32(-1.0)), x1], axis=-1)
            else:
                x1 = mb.slice_by_index(x=x, begin=[0, 0, 0, 0], end=[B, H, L, D], stride=[1, 1, 1, 2])
                x2 = mb.slice_by_index(x=x, begin=[0, 0, 0, 1], end=[B, H, L, D], stride=[1, 1, 1, 2])
                rotated = mb.reshape(
                    x=mb.stack(values=[mb.mul(x=x2, y=np.float32(-1.0)), x1], axis=-1), shape=[B, H, L, D]
                )
            outs.append(mb.add(x=mb.mul(x=x, y=COS), y=mb.mul(x=rotated, y=sin)))
        return tuple(outs)

    return prog


@pytest.mark.parametrize("form", ["concat", "stack"])
def test_runtime_sin_negated_once_for_every_rotation(form):
    prog = runtime_sin(3, form=form)
    ours = run_pass(PASS, prog)
    negations = [
        op
        for op in ours.functions["main"].find_ops(op_type="mul")
        if op.y.val is not None and op.y.val.size == 1 and float(op.y.val) == -1.0
    ]
    assert not negations
    (signed,) = [op for op in ours.functions["main"].find_ops(op_type="mul") if op.x.name == "sin_table"]
    assert {c.op_type for c in signed.outputs[0].child_ops} == {"mul"} and len(
        signed.outputs[0].child_ops
    ) == 3
    assert len(op_types(ours)) == len(op_types(prog)) - 3 + 1  # three negations out, one sign table in
    assert_programs_equivalent(prog, ours, rtol=0.0, atol=0.0)  # multiplying by +-1 is exact


def test_runtime_sin_of_one_rotation_left_alone():
    """One rotation: a ``mul`` by the sign table would replace the one ``mul`` by -1, no op fewer."""
    prog = runtime_sin(1)
    assert op_types(run_pass(PASS, prog)) == op_types(prog)
