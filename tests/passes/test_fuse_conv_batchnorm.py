"""``common::fuse_conv_batchnorm``: ``conv``/``conv_transpose`` then ``batch_norm``, into one convolution.

The data is chosen so that the folded constants are exact in fp32: weights, biases, means, gammas and
betas are multiples of 1/4, and ``variance + epsilon`` is 1, 4 or 16 (``epsilon`` 0.25), so the
per-channel factor ``gamma / sqrt(variance + epsilon)`` is dyadic too. The float64 comparison then holds
to summation-order rounding, and the default tolerances (rtol 1e-5, atol 1e-6) catch any channel
mix-up. (With Gaussian data the folded weights are rounded to fp32, and an output that cancels out
can miss rtol 1e-5.)
"""

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
    conv_weight_shape,
    dyadic_f32,
    op_types,
    run_both,
    run_pass,
)
from pattern_infra.verification.errors import VerificationError
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_conv_batchnorm"
RNG = np.random.default_rng(9)
dyadic = dyadic_f32(RNG)
C_IN, C_OUT = 4, 6
EPSILON = 0.25


def bn_params(gamma_beta: bool = True) -> dict:
    params = {
        "mean": dyadic(C_OUT),
        "variance": (RNG.choice([1.0, 4.0, 16.0], C_OUT) - EPSILON).astype(np.float32),
        "epsilon": np.float32(EPSILON),
    }
    if gamma_beta:
        params.update(gamma=dyadic(C_OUT), beta=dyadic(C_OUT))
    return params


def bn_prog(
    op_type="conv", *, rank=4, bias=True, groups=1, gamma_beta=True, weight=None, extra=None
) -> Program:
    """``batch_norm(conv(x))``; ``extra`` adds an outside use of the convolution or of its input."""
    spatial = (5, 6, 7)[: rank - 2]
    shape = conv_weight_shape(op_type, C_IN, C_OUT, groups=groups, rank=rank)
    w = dyadic(*shape) if weight is None else weight
    b = dyadic(C_OUT)
    params = bn_params(gamma_beta)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, *spatial))])
    def prog(x):
        kwargs = {"x": x, "weight": w, "groups": groups, "name": "conv"}
        if bias:
            kwargs["bias"] = b
        out = getattr(mb, op_type)(**kwargs)
        result = mb.batch_norm(x=out, **params, name="out")
        if extra == "use_conv":
            return result, mb.relu(x=out)
        if extra == "out_conv":
            return result, out
        if extra == "use_root":
            return result, mb.relu(x=x)
        return result

    return prog


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("op_type", ["conv", "conv_transpose"])
def test_fused_as_coremltools_does(op_type, rank, bias):
    ours = check_fused(PASS, bn_prog(op_type, rank=rank, bias=bias), [op_type])
    fused = ours.functions["main"].find_ops(op_type=op_type)[0]
    assert fused.outputs[0].name == "out" and fused.bias.shape == (C_OUT,)


def test_grouped_conv():
    check_fused(PASS, bn_prog("conv", groups=2), ["conv"])


def test_root_with_other_consumers_is_fused():
    check_fused(PASS, bn_prog(extra="use_root"), ["conv", "relu"])


def test_gaussian_data_within_fp32_rounding():
    """Gaussian data: each folded weight is rounded to fp32 (half an ulp); with this data the outputs
    still agree at the default tolerances."""
    weight = RNG.standard_normal((C_OUT, C_IN, 3, 3)).astype(np.float32)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 8, 8))])
    def prog(x):
        out = mb.conv(x=x, weight=weight, bias=RNG.standard_normal(C_OUT).astype(np.float32))
        return mb.batch_norm(
            x=out,
            mean=RNG.standard_normal(C_OUT).astype(np.float32),
            variance=RNG.uniform(0.5, 2.0, C_OUT).astype(np.float32),
            gamma=RNG.standard_normal(C_OUT).astype(np.float32),
            beta=RNG.standard_normal(C_OUT).astype(np.float32),
        )

    outcome = run_both(PASS, prog)
    assert_same_program(outcome.coremltools, outcome.ours)
    assert_programs_equivalent(prog, outcome.ours)


@pytest.mark.parametrize("op_type", ["conv", "conv_transpose"])
def test_without_gamma_and_beta(op_type):
    """``gamma``/``beta`` are optional: coremltools reads ``None.val`` and raises; here they are 1 and 0."""
    prog = bn_prog(op_type, gamma_beta=False)
    with pytest.raises(AttributeError):
        run_pass(PASS, prog, generic=False)
    ours = run_pass(PASS, prog, generic=True)
    assert op_types(ours) == [op_type]
    assert_programs_equivalent(prog, ours)


@pytest.mark.parametrize("rank", [4, 5])
def test_grouped_conv_transpose_scales_the_right_channels(rank):
    """coremltools' reshape interleaves the groups: its per-channel factors land on the wrong channels."""
    prog = bn_prog("conv_transpose", rank=rank, groups=2)
    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == ["conv_transpose"]
    assert_programs_equivalent(prog, outcome.ours)
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, outcome.coremltools)


@pytest.mark.parametrize(
    "extra", ["use_conv", "out_conv"], ids=["intermediate_used_elsewhere", "intermediate_is_block_output"]
)
def test_not_fused(extra):
    check_not_fused(PASS, bn_prog(extra=extra))


def test_non_const_weight_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C_IN, 5, 5)), mb.TensorSpec(shape=(C_OUT, C_IN, 3, 3))])
    def prog(x, w):
        return mb.batch_norm(x=mb.conv(x=x, weight=w), **bn_params())

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
        return mb.batch_norm(x=mb.conv(x=x, weight=weight), **bn_params())

    check_not_fused(PASS, prog)
