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
    """``q * cos + rotate_half(q) * sin`` as coremltools converts transformers' code; ``sin=None``: an input."""
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
    (table,) = [op.y.val for op in ours.functions["main"].find_ops(op_type="mul") if op.x.op is not None and op.x.op.op_type == "concat"]
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
