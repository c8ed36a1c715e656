"""``generic::fuse_linear_scale``: ``linear`` times (divided by) a per-feature constant, into a ``linear``."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra import evaluate
from pattern_infra.testing.convert import convert_torch, op_counts
from pattern_infra.testing.passes import check_new_pass, op_types, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::fuse_linear_scale"
RNG = np.random.default_rng(38)
D_IN, D_OUT = 5, 4


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def check(prog: Program, expected: list[str]) -> Program:
    """Runs the pass; demands op types ``expected`` (``op_types(prog)``: untouched) and equal outputs."""
    return check_new_pass(PASS, prog, expected)  # rtol 1e-5, atol 1e-6: W * s rounded to float32


def scale_prog(op="mul", linear_first=True, s=None, x_shape=(2, 3, D_IN), *, extra=None) -> Program:
    """``linear(x) op s`` (or ``s op linear(x)``), then a ``relu``; ``extra`` adds a decoy."""
    weight, bias = f32(D_OUT, x_shape[-1]), f32(D_OUT)
    s = RNG.uniform(0.5, 2.0, D_OUT).astype(np.float32) if s is None else s

    @mb.program(input_specs=[mb.TensorSpec(shape=x_shape), mb.TensorSpec(shape=(D_OUT,))])
    def prog(x, z):
        lin = mb.linear(x=x, weight=weight, bias=bias, name="lin")
        other = z if extra == "dynamic_s" else s
        args = (lin, other) if linear_first else (other, lin)
        out = mb.relu(x=getattr(mb, op)(x=args[0], y=args[1], name="scaled"), name="out")
        if extra == "use_linear":
            return out, mb.exp(x=lin)
        if extra == "linear_is_output":
            return out, lin
        return out, z

    return prog


@pytest.mark.parametrize(
    "s",
    [np.float32(0.5), f32(1), f32(D_OUT), f32(1, D_OUT), f32(1, 1, D_OUT)],
    ids=["scalar", "one", "vector", "row", "rank3"],
)
@pytest.mark.parametrize(("op", "linear_first"), [("mul", True), ("mul", False), ("real_div", True)])
def test_fused(op, linear_first, s):
    ours = check(scale_prog(op, linear_first, s), ["linear", "relu"])
    (fused,) = ours.functions["main"].find_ops(op_type="linear")
    assert fused.outputs[0].name == "scaled"


@pytest.mark.parametrize("x_shape", [(D_IN,), (3, D_IN), (1, 4, 4, D_IN)], ids=["rank1", "rank2", "rank4"])
def test_ranks(x_shape):
    check(scale_prog(x_shape=x_shape), ["linear", "relu"])


def test_fused_weight_is_the_rounded_product():
    """``W * s`` in float64, rounded once: the correctly rounded float32 product."""
    prog = scale_prog(s=f32(D_OUT))
    ours = run_pass(PASS, prog)
    (before,) = prog.functions["main"].find_ops(op_type="linear")
    (after,) = ours.functions["main"].find_ops(op_type="linear")
    s = prog.functions["main"].find_ops(op_type="mul")[0].y.val
    np.testing.assert_array_equal(after.weight.val, before.weight.val * s[:, None])
    np.testing.assert_array_equal(after.bias.val, before.bias.val * s)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "use_linear"},
        {"extra": "linear_is_output"},
        {"extra": "dynamic_s"},
        {"s": f32(3, D_OUT)},  # varies along rows too: not one value per feature
        {"s": f32(3, 1)},  # along another axis
        {"s": f32(1, 1, 1, D_OUT)},  # would raise the output's rank
        {"op": "real_div", "linear_first": False},  # s / linear
    ],
    ids=[
        "intermediate_used_elsewhere",
        "intermediate_is_output",
        "non_const_s",
        "rows",
        "other_axis",
        "higher_rank",
        "s_over_linear",
    ],
)
def test_not_fused(kwargs):
    prog = scale_prog(**kwargs)
    check(prog, op_types(prog))


def test_fp16():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, D_IN))], opset_version=ct.target.iOS16)
    def prog(x):
        x16 = mb.cast(x=x, dtype="fp16")
        lin = mb.linear(x=x16, weight=f32(D_OUT, D_IN).astype(np.float16), bias=f32(D_OUT).astype(np.float16))
        out = mb.mul(x=lin, y=RNG.uniform(0.5, 2, D_OUT).astype(np.float16))
        return mb.cast(x=out, dtype="fp32")

    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["cast", "linear", "cast"]
    (fused,) = ours.functions["main"].find_ops(op_type="linear")
    assert fused.weight.val.dtype == np.float16 and fused.bias.val.dtype == np.float16
    # one float16 rounding of the folded weight against one of the product: within float16's precision
    assert_programs_equivalent(prog, ours, rtol=2e-3, atol=2e-3)


def test_compressed_weight_takes_the_factors_without_decompressing():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, D_IN))], opset_version=ct.target.iOS18)
    def prog(x):
        weight = mb.constexpr_blockwise_shift_scale(
            data=RNG.integers(-8, 8, (D_OUT, D_IN)).astype(np.int8), scale=f32(D_OUT, 1)
        )
        lin = mb.linear(x=x, weight=weight, bias=f32(D_OUT))
        return mb.mul(x=lin, y=f32(D_OUT))

    ours = run_pass(PASS, prog)
    # the old constexpr op, now unused, is left to dead-code elimination (as fuse_conv_scale leaves it)
    assert op_types(ours) == ["constexpr_blockwise_shift_scale"] * 2 + ["linear"]
    (fused,) = ours.functions["main"].find_ops(op_type="linear")
    assert fused.weight.op.op_type == "constexpr_blockwise_shift_scale"
    assert fused.weight.op.data.val.dtype == np.int8  # the same int8 data, a new scale
    assert_programs_equivalent(prog, ours)


class LayerScaleMlp(torch.nn.Module):
    """A transformer MLP with timm's ``LayerScale`` after it (DeiT III, CaiT)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.gamma = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x))) * self.gamma


def test_layer_scale_folds_in_a_conversion_and_matches_pytorch():
    torch.manual_seed(0)
    model, x = LayerScaleMlp().eval(), torch.randn(2, 6, 8)
    off = convert_torch(model, (x,), override=False)
    on = convert_torch(model, (x,), override=True)
    assert op_counts(off)["mul"] == 1 and op_counts(on)["mul"] == 0
    expected = model(x).detach().numpy()
    for prog in (off, on):
        (out,) = evaluate(prog, {"x": x.numpy()}).values()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
