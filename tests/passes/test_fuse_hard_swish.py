"""``generic::fuse_hard_swish``: ``w * sigmoid_hard(w)``, ``w = thresholded_relu(x, -3)``, loses the clamp."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra import evaluate, explain
from pattern_infra.testing.passes import check_fused, op_types, run_pass

PASS = "generic::fuse_hard_swish"
SHAPE = (2, 3, 8, 8)


def hard_swish_prog(
    t=-3.0, a=1.0 / 6, b=0.5, *, swap: bool = False, extra: str | None = None, dtype=types.fp32
) -> Program:
    """coremltools' lowering of ``Hardswish``; ``swap`` flips the product; ``extra`` adds an outside use."""

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE, dtype=dtype)])
    def prog(x):
        if dtype == types.fp16:
            t_, a_, b_ = np.float16(t), np.float16(a), np.float16(b)
        else:
            t_, a_, b_ = np.float32(t), np.float32(a), np.float32(b)
        w = mb.thresholded_relu(x=x, alpha=t_, name="w")
        s = mb.sigmoid_hard(x=w, alpha=a_, beta=b_, name="s")
        y = mb.mul(x=s, y=w, name="y") if swap else mb.mul(x=w, y=s, name="y")
        if extra == "use_w":
            return y, mb.exp(x=w)
        if extra == "out_s":
            return y, s
        return y

    return prog


@pytest.mark.parametrize("swap", [False, True], ids=["w_s", "s_w"])
def test_the_clamp_goes(swap):
    ours = check_fused(PASS, hard_swish_prog(swap=swap), ["sigmoid_hard", "mul"], same_as_coremltools=False)
    (mul,) = [op for op in ours.functions["main"].operations if op.op_type == "mul"]
    assert mul.outputs[0].name == "y" and mul.x is ours.functions["main"].inputs["x"]


def test_a_gate_that_vanishes_before_the_threshold_fuses():
    check_fused(
        PASS, hard_swish_prog(t=-2.0, a=0.25, b=0.25), ["sigmoid_hard", "mul"], same_as_coremltools=False
    )


def test_a_threshold_further_down_is_redundant_too():
    # a * t + b = -1/6 <= 0: sigmoid_hard is 0 below -3 already, so also below -4
    check_fused(PASS, hard_swish_prog(t=-4.0), ["sigmoid_hard", "mul"], same_as_coremltools=False)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(t=-2.0), "not 0, at the threshold"),
        (dict(a=-1.0 / 6), "not positive"),
        (dict(extra="use_w"), None),
        (dict(extra="out_s"), None),
    ],
    ids=["threshold_above", "falling_gate", "clamp_used_elsewhere", "gate_is_output"],
)
def test_refused(kwargs, reason):
    prog = hard_swish_prog(**kwargs)
    assert op_types(run_pass(PASS, prog)) == op_types(prog)
    if reason:
        assert reason in str(explain(PASS, prog))


def test_float16_constants_fuse():
    prog = hard_swish_prog(dtype=types.fp16)
    assert op_types(run_pass(PASS, prog)) == ["sigmoid_hard", "mul"]


def test_a_torch_hardswish_converts_to_two_ops_with_pytorch_numbers():
    import coremltools as ct

    from pattern_infra import override

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Hardswish()).eval()
    x = torch.randn(1, 3, 8, 8) * 4
    exported = torch.export.export(model, (x,)).run_decompositions({})
    with override():
        prog = ct.convert(
            exported,
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT32,
            skip_model_load=True,
        )._mil_program
    ops = op_types(prog)
    assert "thresholded_relu" not in ops and ops.count("sigmoid_hard") == 1
    (got,) = evaluate(prog, {list(prog.functions["main"].inputs)[0]: x.numpy()}).values()
    want = model(x).detach().numpy()
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= 1e-5 * np.max(np.abs(want))
