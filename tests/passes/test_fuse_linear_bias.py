"""``common::fuse_linear_bias``: ``linear`` then ``add``/``sub`` of a constant, into one ``linear``."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import (
    assert_same_program,
    check_fused,
    check_not_fused,
    normal_f32,
    op_types,
    run_both,
    run_pass,
)
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_linear_bias"
f32 = normal_f32(np.random.default_rng(7))


def linear_prog(
    op: str = "add",
    linear_first: bool = True,
    c=None,
    x_shape=(2, 3),
    *,
    d_out: int = 4,
    extra: str | None = None,
) -> Program:
    """``linear(x) op c`` (or ``c op linear(x)``); ``extra`` adds an outside use or a dynamic ``c``."""
    weight, bias = f32(d_out, x_shape[-1]), f32(d_out)
    c = f32(d_out) if c is None else c

    @mb.program(input_specs=[mb.TensorSpec(shape=x_shape), mb.TensorSpec(shape=(d_out,))])
    def prog(x, z):
        lin = mb.linear(x=x, weight=weight, bias=bias, name="lin")
        other = z if extra == "dynamic_c" else c
        args = (lin, other) if linear_first else (other, lin)
        out = getattr(mb, op)(x=args[0], y=args[1], name="out")
        if extra == "use_linear":
            return out, mb.relu(x=lin)
        if extra == "out_linear":
            return out, lin
        if extra == "use_root":
            return out, mb.relu(x=x)
        return out, z

    return prog


@pytest.mark.parametrize("c_shape", [(4,), (1, 4)], ids=["c_vec", "c_row"])
@pytest.mark.parametrize("linear_first", [True, False], ids=["linear_c", "c_linear"])
@pytest.mark.parametrize("op", ["add", "sub"])
def test_fused_as_coremltools_does(op, linear_first, c_shape):
    ours = check_fused(PASS, linear_prog(op, linear_first, f32(*c_shape)), ["linear"])
    fused = ours.functions["main"].find_ops(op_type="linear")[0]
    assert fused.outputs[0].name == "out"


@pytest.mark.parametrize("x_shape", [(3,), (2, 5, 3)], ids=["rank1", "rank3"])
def test_input_ranks(x_shape):
    check_fused(PASS, linear_prog("sub", False, x_shape=x_shape), ["linear"])


def test_chain_folds_into_one_linear():
    weight, bias = f32(4, 3), f32(4)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        lin = mb.linear(x=x, weight=weight, bias=bias)
        return mb.sub(x=f32(4), y=mb.add(x=f32(1, 4), y=lin))

    check_fused(PASS, prog, ["linear"])


def test_root_with_other_consumers_is_fused():
    check_fused(PASS, linear_prog(extra="use_root"), ["linear", "relu"])


def test_inside_a_nested_block():
    weight, bias, c = f32(4, 3), f32(4), f32(4)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        def branch():
            return mb.add(x=mb.linear(x=x, weight=weight, bias=bias), y=c)

        def other_branch():
            return mb.relu(x=mb.linear(x=x, weight=weight, bias=bias))

        return mb.cond(pred=True, _true_fn=branch, _false_fn=other_branch)

    outcome = run_both(PASS, prog)
    assert_same_program(outcome.coremltools, outcome.ours)
    inner = outcome.ours.functions["main"].find_ops(op_type="cond")[0].blocks[0]
    assert [op.op_type for op in inner.operations if op.op_type != "const"] == ["linear"]
    assert_programs_equivalent(prog, outcome.ours)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "use_linear"},
        {"extra": "out_linear"},
        {"extra": "dynamic_c"},
        {"c": f32(2, 4)},
        {"c": f32(4, 1), "x_shape": (4, 3)},
    ],
    ids=[
        "intermediate_used_elsewhere",
        "intermediate_is_block_output",
        "non_const_c",
        "c_too_many_values",
        "c_on_wrong_axis",
    ],
)
def test_not_fused(kwargs):
    check_not_fused(PASS, linear_prog(**kwargs))


def test_constexpr_weight_is_fused_where_coremltools_leaves_it():
    """An iOS16 int8 weight: the factor goes into its scale (tests/test_compressed_weights.py has more)."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))], opset_version=ct.target.iOS16)
    def prog(x):
        weight = mb.constexpr_affine_dequantize(
            quantized_data=np.ones((4, 3), np.uint8), zero_point=np.uint8(0), scale=np.float32(0.5), axis=0
        )
        return mb.add(x=mb.linear(x=x, weight=weight, bias=f32(4)), y=f32(4))

    outcome = run_both(PASS, prog)
    assert op_types(outcome.coremltools) == op_types(prog)
    assert op_types(outcome.ours) == ["constexpr_affine_dequantize", "linear"]
    assert_programs_equivalent(prog, outcome.ours)


def test_c_that_raises_the_output_rank_is_not_fused():
    """coremltools fuses (2, 4) + (1, 1, 4) and the output loses its leading dimension."""
    prog = linear_prog(c=f32(1, 1, 4))
    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == ["linear", "add"]
    assert outcome.coremltools.functions["main"].outputs[0].shape == (2, 4)
    assert outcome.ours.functions["main"].outputs[0].shape == (1, 2, 4)


def test_scalar_c_with_one_output_channel():
    """coremltools raises IndexError (it reads ``c.shape[-1]`` of a scalar); the fusion is right."""
    prog = linear_prog("sub", True, np.float32(0.75), d_out=1)
    with pytest.raises(IndexError):
        run_pass(PASS, prog, generic=False)
    ours = run_pass(PASS, prog, generic=True)
    assert op_types(ours) == ["linear"]
    assert_programs_equivalent(prog, ours)
