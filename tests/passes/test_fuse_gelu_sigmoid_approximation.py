"""Quick GELU ``x * sigmoid(1.702 * x)``: fused by ``generic::fuse_gelu_sigmoid_approximation`` and, under the
override, by ``common::fuse_gelu_exact`` (so by ``coremltools.convert``); coremltools alone never fuses it."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.fuse_gelu_sigmoid_approximation import quick_gelu_pattern
from pattern_infra.testing.convert import convert_torch
from pattern_infra.testing.models import quick_gelu
from pattern_infra.testing.passes import check_fused, op_types, run_both, run_pass
from pattern_infra.verification.symbolic import prove_equivalent
from pattern_infra.verification.verify import assert_programs_equivalent

NEW_PASS = "generic::fuse_gelu_sigmoid_approximation"
EXTENDED_PASS = "common::fuse_gelu_exact"
SHAPE = (2, 3, 4)


def quick_gelu_prog(swap: bool = False, *, k: float = 1.702, extra: str | None = None) -> Program:
    """``x * sigmoid(1.702 * x)``; ``swap`` flips both muls; ``extra`` adds an outside use."""

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        scaled = mb.mul(x=k, y=x, name="scale") if swap else mb.mul(x=x, y=k, name="scale")
        sig = mb.sigmoid(x=scaled, name="sigmoid")
        y = mb.mul(x=sig, y=x, name="y") if swap else mb.mul(x=x, y=sig, name="y")
        if extra == "use_sigmoid":
            return y, mb.exp(x=sig)
        if extra == "out_scale":
            return y, scaled
        if extra == "use_root":
            return y, mb.exp(x=x)
        return y

    return prog


def test_gelu_sigmoid_mode_is_exactly_quick_gelu():
    """coremltools' definition of the mode is x * sigmoid(1.702 x) (its value inference, here)."""
    x = np.linspace(-6, 6, 25).astype(np.float32)

    @mb.program(input_specs=[mb.TensorSpec(shape=(25,))])
    def prog(x_in):
        return mb.gelu(x=mb.const(val=x), mode="SIGMOID_APPROXIMATION")

    out = prog.functions["main"].outputs[0].val
    np.testing.assert_allclose(out, x / (1 + np.exp(-1.702 * x)), rtol=1e-6)


@pytest.mark.parametrize("pass_id", [NEW_PASS, EXTENDED_PASS])
@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
def test_quick_gelu_is_fused(pass_id, swap):
    ours = check_fused(pass_id, quick_gelu_prog(swap), ["gelu"], same_as_coremltools=False, prove=True)
    (gelu,) = [op for op in ours.functions["main"].operations if op.op_type == "gelu"]
    assert gelu.mode.val == "SIGMOID_APPROXIMATION" and gelu.outputs[0].name == "y"


def test_coremltools_leaves_it_unfused():
    outcome = run_both(EXTENDED_PASS, quick_gelu_prog())
    assert op_types(outcome.coremltools) == ["mul", "sigmoid", "mul"]
    assert op_types(outcome.ours) == ["gelu"]


def test_root_with_other_consumers_is_fused():
    check_fused(
        NEW_PASS, quick_gelu_prog(extra="use_root"), ["gelu", "exp"], same_as_coremltools=False, prove=True
    )


def test_symbolic_shape_is_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), 4))])
    def prog(x):
        return mb.mul(x=x, y=mb.sigmoid(x=mb.mul(x=x, y=1.702)))

    assert op_types(run_pass(NEW_PASS, prog)) == ["gelu"]


@pytest.mark.parametrize(
    "kwargs",
    [{"extra": "use_sigmoid"}, {"extra": "out_scale"}, {"k": 1.5}, {"k": 1.0}],
    ids=["intermediate_used_elsewhere", "intermediate_is_block_output", "wrong_constant", "silu"],
)
@pytest.mark.parametrize("pass_id", [NEW_PASS, EXTENDED_PASS])
def test_not_fused(pass_id, kwargs):
    prog = quick_gelu_prog(**kwargs)
    assert op_types(run_pass(pass_id, prog)) == op_types(prog)


def test_non_constant_scale_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE), mb.TensorSpec(shape=SHAPE)])
    def prog(x, k):
        return mb.mul(x=x, y=mb.sigmoid(x=mb.mul(x=x, y=k)))

    assert op_types(run_pass(NEW_PASS, prog)) == op_types(prog)


def test_convert_fuses_clip_quick_gelu_under_the_override():
    """The op chain torch.export + coremltools produce reaches fuse_gelu_exact and is fused there."""

    class QuickGelu(torch.nn.Module):
        def forward(self, x):
            return quick_gelu(x)

    args = (torch.randn(2, 8),)
    kwargs = {"minimum_deployment_target": ct.target.iOS17}
    plain = convert_torch(QuickGelu(), args, override=False, **kwargs)
    fused = convert_torch(QuickGelu(), args, override=True, **kwargs)
    assert op_types(plain) == ["mul", "sigmoid", "mul"]
    assert op_types(fused) == ["gelu"]
    assert [op.mode.val for op in fused.functions["main"].operations if op.op_type == "gelu"] == [
        "SIGMOID_APPROXIMATION"
    ]
    assert_programs_equivalent(plain, fused, rtol=1e-5)


def test_pattern_equals_its_replacement_symbolically():
    fused = run_pass(NEW_PASS, quick_gelu_pattern)
    assert op_types(fused) == ["gelu"]
    assert (proof := prove_equivalent(quick_gelu_pattern, fused)).proven, proof
