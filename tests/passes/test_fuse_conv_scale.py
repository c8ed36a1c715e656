"""``common::fuse_conv_scale``: ``conv``/``conv_transpose`` then ``mul``/``real_div`` by a constant.

Weights, biases and scales are dyadic (multiples of 1/4, powers of two), so the folded constants are
exact in fp32 and the float64 comparison holds to summation-order rounding: the default tolerances
(rtol 1e-5, atol 1e-6) then catch any channel mix-up, however small. With Gaussian data, folding
rounds each weight to fp32 and an output that cancels out can miss rtol 1e-5.
"""

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
    dyadic_f32,
    op_types,
    run_both,
    run_pass,
    sampled_conv,
)
from pattern_infra.verification.errors import VerificationError
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_conv_scale"
RNG = np.random.default_rng(5)
dyadic = dyadic_f32(RNG)
C_IN, C_OUT = 4, 6


def powers_of_two(*shape):
    return (RNG.choice([-2.0, -0.5, 0.5, 2.0, 4.0], shape)).astype(np.float32)


S_FORMS = {
    "scalar": lambda rank: np.float32(2.0),
    "size1": lambda rank: np.array([0.5], np.float32),
    "channels": lambda rank: powers_of_two(C_OUT, *(1,) * (rank - 2)),
    "batch_channels": lambda rank: powers_of_two(1, C_OUT, *(1,) * (rank - 2)),
}


def scale_prog(
    op_type="conv",
    op="mul",
    conv_first=True,
    s="channels",
    *,
    rank=4,
    bias=True,
    groups=1,
    extra=None,
    spatial=None,
) -> Program:
    """``conv(x) op s`` (or ``s op conv(x)``); ``extra`` adds an outside use or a dynamic ``s``."""
    s_val = S_FORMS[s](rank) if isinstance(s, str) else s
    spatial = spatial or (5, 6, 7)[: rank - 2]

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, *spatial)), mb.TensorSpec(shape=(C_OUT, 1, 1))])
    def prog(x, z):
        out = sampled_conv(x, op_type, C_OUT, dyadic, bias=bias, groups=groups)
        other = z if extra == "dynamic_s" else s_val
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


@pytest.mark.parametrize("s", list(S_FORMS))
@pytest.mark.parametrize(
    "op, conv_first",
    [("mul", True), ("mul", False), ("real_div", True)],
    ids=["conv_s", "s_conv", "conv_div_s"],
)
@pytest.mark.parametrize("op_type", ["conv", "conv_transpose"])
def test_fused_as_coremltools_does(op_type, op, conv_first, s):
    ours = check_fused(PASS, scale_prog(op_type, op, conv_first, s), [op_type])
    fused = ours.functions["main"].find_ops(op_type=op_type)[0]
    assert fused.outputs[0].name == "out" and fused.bias.shape == (C_OUT,)


@pytest.mark.parametrize("s", ["scalar", "channels"])
@pytest.mark.parametrize("op_type", ["conv", "conv_transpose"])
def test_without_bias(op_type, s):
    check_fused(PASS, scale_prog(op_type, "real_div", True, s, bias=False), [op_type])


@pytest.mark.parametrize("rank", [3, 5])
def test_conv_ranks_and_groups(rank):
    check_fused(PASS, scale_prog("conv", "mul", False, "batch_channels", rank=rank, groups=2), ["conv"])


def test_conv_transpose_1d_and_3d_scalar():
    check_fused(PASS, scale_prog("conv_transpose", "mul", True, "channels", rank=3), ["conv_transpose"])
    check_fused(PASS, scale_prog("conv_transpose", "mul", True, "scalar", rank=5), ["conv_transpose"])


def test_root_with_other_consumers_is_fused():
    check_fused(PASS, scale_prog(extra="use_root"), ["conv", "relu"])


def test_fp16():
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C_IN, 5, 5))], opset_version=ct.target.iOS16)
    def prog(x):
        x16 = mb.cast(x=x, dtype="fp16")
        w = dyadic(C_OUT, C_IN, 3, 3).astype(np.float16)
        out = mb.mul(x=mb.conv(x=x16, weight=w), y=powers_of_two(C_OUT, 1, 1).astype(np.float16))
        return mb.cast(x=out, dtype="fp32")

    check_fused(PASS, prog, ["cast", "conv", "cast"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "use_conv"},
        {"extra": "out_conv"},
        {"extra": "dynamic_s"},
        {"s": powers_of_two(1, 1, 1, 4)},
        {"s": powers_of_two(C_OUT), "spatial": (5, 8)},
    ],
    ids=[
        "intermediate_used_elsewhere",
        "intermediate_is_block_output",
        "non_const_s",
        "s_along_width",
        "s_of_cout_values_along_width",
    ],
)
def test_not_fused(kwargs):
    check_not_fused(PASS, scale_prog(**kwargs))


def test_non_const_weight_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5)), mb.TensorSpec(shape=(C_OUT, C_IN, 3, 3))])
    def prog(x, w):
        return mb.mul(x=mb.conv(x=x, weight=w), y=np.float32(2.0))

    check_not_fused(PASS, prog)


def test_constexpr_weight_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5))], opset_version=ct.target.iOS16)
    def prog(x):
        weight = mb.constexpr_affine_dequantize(
            quantized_data=np.ones((C_OUT, C_IN, 3, 3), np.uint8),
            zero_point=np.uint8(0),
            scale=np.float32(0.5),
            axis=0,
        )
        return mb.mul(x=mb.conv(x=x, weight=weight), y=np.float32(2.0))

    check_not_fused(PASS, prog)


def test_s_divided_by_conv_is_not_fused():
    """coremltools folds ``s / conv`` as ``conv / s``."""
    prog = scale_prog("conv", "real_div", False, "channels")
    outcome = check_not_fused(PASS, prog, same_as_coremltools=False)
    assert op_types(outcome.coremltools) == ["conv"]
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, outcome.coremltools)


@pytest.mark.parametrize("op", ["mul", "real_div"])
def test_grouped_conv_transpose_scales_the_right_channels(op):
    """coremltools' reshape interleaves the groups: its per-channel factors land on the wrong channels."""
    prog = scale_prog("conv_transpose", op, True, "channels", groups=2)
    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == ["conv_transpose"]
    assert_programs_equivalent(prog, outcome.ours)
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, outcome.coremltools)


def test_conv_transpose_3d_per_channel():
    """coremltools transposes the 5-D weight with a 4-axis permutation and raises."""
    prog = scale_prog("conv_transpose", "mul", True, "channels", rank=5, groups=2)
    with pytest.raises(ValueError, match="axes"):
        run_pass(PASS, prog, generic=False)
    ours = run_pass(PASS, prog, generic=True)
    assert op_types(ours) == ["conv_transpose"]
    assert_programs_equivalent(prog, ours)
