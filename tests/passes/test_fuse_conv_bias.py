"""``common::fuse_conv_bias``: ``conv``/``conv_transpose`` (``transpose``) then ``add``/``sub`` of a
constant."""

from __future__ import annotations

import coremltools as ct
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
    sampled_conv,
)
from pattern_infra.verification.errors import VerificationError
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_conv_bias"
f32 = normal_f32(np.random.default_rng(3))
C_IN, C_OUT = 4, 6


C_FORMS = {
    "scalar": lambda rank: np.float32(1.5),
    "size1": lambda rank: f32(*(1,) * (rank - 1)),
    "channels": lambda rank: f32(C_OUT, *(1,) * (rank - 2)),
    "batch_channels": lambda rank: f32(1, C_OUT, *(1,) * (rank - 2)),
}


def bias_prog(
    op_type="conv", op="add", conv_first=True, c="channels", *, rank=4, bias=True, groups=1, extra=None
) -> Program:
    """``conv(x) op c`` (or ``c op conv(x)``); ``extra`` adds an outside use or a dynamic ``c``."""
    c_val = C_FORMS[c](rank) if isinstance(c, str) else c
    spatial = (5, 6, 7)[: rank - 2]

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, *spatial)), mb.TensorSpec(shape=(C_OUT, 1, 1))])
    def prog(x, z):
        out = sampled_conv(x, op_type, C_OUT, f32, bias=bias, groups=groups)
        other = z if extra == "dynamic_c" else c_val
        args = (out, other) if conv_first else (other, out)
        result = getattr(mb, op)(x=args[0], y=args[1], name="out")
        if extra == "use_conv":
            return result, mb.relu(x=out)
        if extra == "out_conv":
            return result, out
        if extra == "use_root":
            return result, mb.relu(x=x)
        return result, z

    return prog


def transposed_prog(
    op_type="conv", op="add", conv_first=True, perm=(0, 2, 3, 1), *, bias=True, c=None, extra=None, hw=(5, 7)
) -> Program:
    """``transpose(conv(x), perm) op c``, ``c`` along the channels' new axis unless given; ``x`` is
    (2, 4, *hw)."""
    axis = [p % 4 for p in perm].index(1)
    c_val = f32(*[C_OUT if i == axis else 1 for i in range(4)][axis:]) if c is None else c

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, *hw))])
    def prog(x):
        out = mb.transpose(
            x=sampled_conv(x, op_type, C_OUT, f32, bias=bias), perm=list(perm), name="transpose"
        )
        args = (out, c_val) if conv_first else (c_val, out)
        result = getattr(mb, op)(x=args[0], y=args[1], name="out")
        if extra == "use_transpose":
            return result, mb.relu(x=out)
        return result

    return prog


OPS = [("add", True), ("add", False), ("sub", True)]
OP_IDS = ["conv_plus_c", "c_plus_conv", "conv_minus_c"]


# -- pattern 1 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", list(C_FORMS))
@pytest.mark.parametrize("op, conv_first", OPS, ids=OP_IDS)
@pytest.mark.parametrize("op_type", ["conv", "conv_transpose"])
def test_fused_as_coremltools_does(op_type, op, conv_first, c):
    ours = check_fused(PASS, bias_prog(op_type, op, conv_first, c), [op_type])
    fused = ours.functions["main"].find_ops(op_type=op_type)[0]
    assert fused.outputs[0].name == "out" and fused.bias.shape == (C_OUT,)


@pytest.mark.parametrize("c", ["scalar", "channels"])
@pytest.mark.parametrize("op_type", ["conv", "conv_transpose"])
def test_without_bias(op_type, c):
    check_fused(PASS, bias_prog(op_type, "sub", True, c, bias=False), [op_type])


@pytest.mark.parametrize("rank", [3, 5])
def test_ranks(rank):
    check_fused(PASS, bias_prog("conv", "add", False, "batch_channels", rank=rank, groups=2), ["conv"])


def test_chain_and_root_with_other_consumers():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5))])
    def prog(x):
        out = mb.add(x=mb.sub(x=sampled_conv(x, "conv", C_OUT, f32), y=f32(C_OUT, 1, 1)), y=np.float32(0.25))
        return out, mb.relu(x=x)

    check_fused(PASS, prog, ["conv", "relu"])


def test_non_const_weight_keeps_its_var():
    """The weight is passed on as is, so it need not be a constant (as in coremltools)."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5)), mb.TensorSpec(shape=(C_OUT, C_IN, 3, 3))])
    def prog(x, w):
        return mb.add(x=mb.conv(x=x, weight=w, bias=f32(C_OUT)), y=f32(C_OUT, 1, 1))

    check_fused(PASS, prog, ["conv"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "use_conv"},
        {"extra": "out_conv"},
        {"extra": "dynamic_c"},
        {"op": "sub", "conv_first": False},
        {"c": f32(1, 1, 1, 4)},
        {"c": f32(2, 1, 1, 1)},
        {"c": f32(C_OUT, 3, 1)},
    ],
    ids=[
        "intermediate_used_elsewhere",
        "intermediate_is_block_output",
        "non_const_c",
        "c_minus_conv",
        "c_along_width",
        "c_along_batch",
        "c_along_two_axes",
    ],
)
def test_not_fused(kwargs):
    check_not_fused(PASS, bias_prog(**kwargs))


def test_c_that_raises_the_output_rank_is_not_fused():
    """coremltools fuses (2, 6, 3, 3) + (1, 1, 6, 1, 1) and the output loses its leading dimension."""
    outcome = check_not_fused(PASS, bias_prog(c=f32(1, 1, C_OUT, 1, 1)), same_as_coremltools=False)
    assert outcome.coremltools.functions["main"].outputs[0].rank == 4
    assert outcome.ours.functions["main"].outputs[0].rank == 5


def test_shared_constant_is_not_changed():
    """coremltools negates ``c`` in place for ``sub``, changing it for its other user too."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5)), mb.TensorSpec(shape=(1, C_OUT, 1, 1))])
    def prog(x, z):
        c = mb.const(val=f32(C_OUT, 1, 1))
        return mb.sub(x=sampled_conv(x, "conv", C_OUT, f32), y=c), mb.add(x=z, y=c)

    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == ["conv", "add"]
    assert_programs_equivalent(prog, outcome.ours)
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, outcome.coremltools)


def test_grouped_conv_transpose_scalar_without_bias():
    """coremltools builds ``weight.shape[1]`` bias values instead of ``Cout`` and raises."""
    prog = bias_prog("conv_transpose", "add", True, "scalar", bias=False, groups=2)
    with pytest.raises(ValueError, match="bias"):
        run_pass(PASS, prog, generic=False)
    ours = run_pass(PASS, prog, generic=True)
    assert op_types(ours) == ["conv_transpose"]
    assert_programs_equivalent(prog, ours)


def test_scalar_without_bias_needs_no_constant_weight():
    """``Cout`` comes from the weight's static shape; coremltools reads the weight's value and refuses."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5)), mb.TensorSpec(shape=(C_OUT, C_IN, 3, 3))])
    def prog(x, w):
        return mb.add(x=mb.conv(x=x, weight=w), y=np.float32(0.5))

    outcome = run_both(PASS, prog)
    assert op_types(outcome.coremltools) == ["conv", "add"]
    assert op_types(outcome.ours) == ["conv"]
    assert_programs_equivalent(prog, outcome.ours)


def test_constexpr_bias_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5))], opset_version=ct.target.iOS16)
    def prog(x):
        bias = mb.constexpr_affine_dequantize(
            quantized_data=np.ones(C_OUT, np.uint8), zero_point=np.uint8(0), scale=np.float32(0.5), axis=0
        )
        return mb.add(x=mb.conv(x=x, weight=f32(C_OUT, C_IN, 3, 3), bias=bias), y=f32(C_OUT, 1, 1))

    check_not_fused(PASS, prog)


# -- pattern 2 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("perm", [(0, 2, 3, 1), (0, 1, 3, 2), (2, 1, 0, 3)], ids=["nhwc", "hw", "swap_nh"])
@pytest.mark.parametrize("op, conv_first", OPS + [("sub", False)], ids=OP_IDS + ["c_minus_conv"])
@pytest.mark.parametrize("op_type", ["conv", "conv_transpose"])
def test_transposed_fused_as_coremltools_does(op_type, op, conv_first, perm):
    ours = check_fused(PASS, transposed_prog(op_type, op, conv_first, perm), [op_type, "transpose"])
    assert ours.functions["main"].find_ops(op_type="transpose")[0].outputs[0].name == "out"


@pytest.mark.parametrize("c", [np.float32(2.0), np.full((1, 1), 2.0, np.float32)], ids=["scalar", "size1"])
def test_transposed_scalar_without_bias(c):
    check_fused(PASS, transposed_prog("conv", "sub", False, c=c, bias=False), ["conv", "transpose"])


def test_transposed_negative_perm():
    """coremltools looks ``1`` up in the raw ``perm`` and raises on ``(0, -2, -1, -3)``."""
    prog = transposed_prog("conv", "add", True, (0, -2, -1, -3))
    with pytest.raises(ValueError):
        run_pass(PASS, prog, generic=False)
    ours = run_pass(PASS, prog, generic=True)
    assert op_types(ours) == ["conv", "transpose"]
    assert_programs_equivalent(prog, ours)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "use_transpose"},
        {"c": f32(1, C_OUT, 1, 1), "hw": (8, 7)},
        {"c": f32(1, 1, 5, C_OUT)},
    ],
    ids=["intermediate_used_elsewhere", "c_along_another_axis_of_cout_values", "c_along_two_axes"],
)
def test_transposed_not_fused(kwargs):
    check_not_fused(PASS, transposed_prog(**kwargs))


def test_transposed_c_with_too_few_axes_is_not_fused():
    """``c`` (6,) against channels on axis 0 of the transposed output: coremltools raises IndexError."""
    prog = transposed_prog("conv", "add", True, (1, 0, 2, 3), c=f32(C_OUT), hw=(5, 8))
    with pytest.raises(IndexError):
        run_pass(PASS, prog, generic=False)
    assert op_types(run_pass(PASS, prog, generic=True)) == op_types(prog)


def test_transposed_non_const_weight_is_not_fused():
    """Pattern 2 writes a new weight; coremltools raises reading the dtype of a missing value."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5)), mb.TensorSpec(shape=(C_OUT, C_IN, 3, 3))])
    def prog(x, w):
        out = mb.transpose(x=mb.conv(x=x, weight=w), perm=[0, 2, 3, 1])
        return mb.add(x=out, y=f32(C_OUT))

    with pytest.raises(AttributeError):
        run_pass(PASS, prog, generic=False)
    assert op_types(run_pass(PASS, prog, generic=True)) == op_types(prog)
