"""``common::fuse_matmul_weight_bias``: ``matmul`` by a constant matrix, then ``add``/``sub`` of a
constant."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import (
    check_fused,
    check_not_fused,
    normal_f32,
    op_types,
    run_both,
    run_pass,
)
from pattern_infra.verification.errors import VerificationError
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_matmul_weight_bias"
f32 = normal_f32(np.random.default_rng(11))


def matmul_prog(
    op: str = "add",
    matmul_first: bool = True,
    *,
    weight_left: bool = False,
    transpose_x: bool = False,
    transpose_w: bool = False,
    c=None,
    x_shape=(2, 5, 3),
    extra: str | None = None,
) -> Program:
    """``matmul(x, W) op c``; W (3, 4) on the right, or (4, 3) on the left of x (…, 3, 5)."""
    k, n = 3, 4
    if weight_left:
        weight = f32(k, n) if transpose_w else f32(n, k)
        c = f32(n, 1) if c is None else c
        x_shape = x_shape[:-2] + ((5, k) if transpose_x else (k, 5))
    else:
        weight = f32(n, k) if transpose_w else f32(k, n)
        c = f32(n) if c is None else c
        x_shape = x_shape[:-2] + (x_shape[-1], x_shape[-2]) if transpose_x else x_shape

    @mb.program(input_specs=[mb.TensorSpec(shape=x_shape), mb.TensorSpec(shape=np.shape(c) or (1,))])
    def prog(x, z):
        w = z if extra == "dynamic_weight" else weight
        if weight_left:
            mm = mb.matmul(x=w, y=x, transpose_x=transpose_w, transpose_y=transpose_x, name="mm")
        else:
            mm = mb.matmul(x=x, y=w, transpose_x=transpose_x, transpose_y=transpose_w, name="mm")
        other = z if extra == "dynamic_c" else c
        out = (
            getattr(mb, op)(x=mm, y=other, name="out")
            if matmul_first
            else getattr(mb, op)(x=other, y=mm, name="out")
        )
        if extra == "use_matmul":
            return out, mb.relu(x=mm)
        if extra == "out_matmul":
            return out, mm
        if extra == "use_root":
            return out, mb.relu(x=x)
        return out, z

    return prog


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
@pytest.mark.parametrize("transpose_x", [False, True], ids=["x", "xT"])
@pytest.mark.parametrize("matmul_first", [True, False], ids=["mm_c", "c_mm"])
def test_add_fused_as_coremltools_does(matmul_first, transpose_x, transpose_w):
    expected = ["transpose"] * transpose_x + ["transpose"] * (not transpose_w) + ["linear"]
    check_fused(
        PASS, matmul_prog("add", matmul_first, transpose_x=transpose_x, transpose_w=transpose_w), expected
    )


@pytest.mark.parametrize("c_shape", [(4,), (1, 4), (1, 1, 4)], ids=["c_vec", "c_row", "c_rank3"])
def test_sub_fused_as_coremltools_does(c_shape):
    ours = check_fused(PASS, matmul_prog("sub", True, c=f32(*c_shape)), ["transpose", "linear"])
    assert ours.functions["main"].find_ops(op_type="linear")[0].outputs[0].name == "out"


@pytest.mark.parametrize("x_shape", [(5, 3), (2, 2, 5, 3)], ids=["rank2", "rank4"])
def test_input_ranks(x_shape):
    check_fused(PASS, matmul_prog(x_shape=x_shape), ["transpose", "linear"])


def test_root_with_other_consumers_is_fused():
    check_fused(PASS, matmul_prog(extra="use_root"), ["transpose", "linear", "relu"])


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
def test_c_minus_matmul_negates_the_weight(transpose_w):
    """coremltools computes ``matmul - c`` for ``c - matmul``; here the weight is negated instead."""
    prog = matmul_prog("sub", False, transpose_w=transpose_w)
    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == ["linear"]
    assert_programs_equivalent(prog, outcome.ours)
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, outcome.coremltools)


@pytest.mark.parametrize("op, matmul_first", [("add", True), ("sub", True), ("sub", False)])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
@pytest.mark.parametrize("transpose_x", [False, True], ids=["x", "xT"])
def test_weight_on_the_left(op, matmul_first, transpose_x, transpose_w):
    """``W @ x + c`` with ``c`` along axis -2 (coremltools refuses it): transpose, linear, transpose."""
    prog = matmul_prog(op, matmul_first, weight_left=True, transpose_x=transpose_x, transpose_w=transpose_w)
    outcome = run_both(PASS, prog)
    assert op_types(outcome.coremltools) == op_types(prog)
    assert op_types(outcome.ours)[-2:] == ["linear", "transpose"]
    assert outcome.ours.functions["main"].outputs[0].name == "out"
    assert_programs_equivalent(prog, outcome.ours)


def test_weight_on_the_left_with_c_on_the_last_axis_is_not_fused():
    """coremltools fuses it (when the shapes allow) with ``c`` on the wrong axis."""
    weight, c = f32(3, 3), f32(3)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 3))])
    def prog(x):
        return mb.add(x=mb.matmul(x=weight, y=x), y=c)

    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == ["matmul", "add"]
    assert op_types(outcome.coremltools) == ["transpose", "linear", "transpose"]
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, outcome.coremltools)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "use_matmul"},
        {"extra": "dynamic_c"},
        {"c": f32(2, 1, 4)},
        {"c": f32(5, 4), "x_shape": (5, 3)},
        {"c": np.float32(1.5)},
    ],
    ids=["intermediate_used_elsewhere", "non_const_c", "c_varies_along_batch", "c_2d", "scalar_c"],
)
def test_not_fused(kwargs):
    check_not_fused(PASS, matmul_prog(**kwargs))


def test_intermediate_block_output_is_not_fused():
    """coremltools rewrites it and then fails to remove the ``matmul``; nothing changes here."""
    prog = matmul_prog(extra="out_matmul")
    with pytest.raises(ValueError, match="cannot delete op mm"):
        run_pass(PASS, prog, generic=False)
    assert op_types(run_pass(PASS, prog, generic=True)) == op_types(prog)


def test_non_const_weight_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(5, 3)), mb.TensorSpec(shape=(3, 4))])
    def prog(x, w):
        return mb.add(x=mb.matmul(x=x, y=w), y=f32(4))

    check_not_fused(PASS, prog)


def test_weight_of_rank_3_or_shared_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 5, 3))])
    def prog(x):
        shared = mb.const(val=f32(3, 4))
        a = mb.add(x=mb.matmul(x=x, y=shared), y=f32(4))
        b = mb.add(x=mb.matmul(x=x, y=shared), y=f32(4))
        c = mb.add(x=mb.matmul(x=x, y=f32(2, 3, 4)), y=f32(4))
        return a, b, c

    check_not_fused(PASS, prog)


def test_rank_1_input_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(3,))])
    def prog(x):
        return mb.add(x=mb.matmul(x=x, y=f32(3, 4)), y=f32(4))

    check_not_fused(PASS, prog)


def test_c_that_raises_the_output_rank_is_not_fused():
    """coremltools fuses (5, 4) + (1, 1, 4) and the output loses its leading dimension."""
    prog = matmul_prog(c=f32(1, 1, 4), x_shape=(5, 3))
    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == ["matmul", "add"]
    assert outcome.coremltools.functions["main"].outputs[0].shape == (5, 4)
