"""``mil_backend::fuse_activation_silu``: ``x * sigmoid(x)`` into ``silu``."""

from __future__ import annotations

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.fuse_activation_silu import silu_pattern
from pattern_infra.testing.passes import check_fused, op_types, run_pass
from pattern_infra.verification.symbolic import ProofStatus, prove_equivalent

PASS = "mil_backend::fuse_activation_silu"
SHAPE = (2, 3, 4)


def silu_prog(swap: bool = False, *, extra: str | None = None) -> Program:
    """``x * sigmoid(x)``; ``extra``: ``"use_sigmoid"``, ``"out_sigmoid"``, ``"use_root"``, ``"other"``
    (``z * sigmoid(x)``)."""

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE), mb.TensorSpec(shape=SHAPE)])
    def prog(x, z):
        sig = mb.sigmoid(x=x, name="sigmoid")
        other = z if extra == "other" else x
        y = mb.mul(x=sig, y=other, name="y") if swap else mb.mul(x=other, y=sig, name="y")
        if extra == "use_sigmoid":
            return y, mb.exp(x=sig)
        if extra == "out_sigmoid":
            return y, sig
        if extra == "use_root":
            return y, mb.add(x=x, y=z)
        return y, z

    return prog


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
def test_fused_as_coremltools_does(swap):
    ours = check_fused(PASS, silu_prog(swap), ["silu"], prove=True)
    (silu,) = [op for op in ours.functions["main"].operations if op.op_type == "silu"]
    assert silu.x.name == "x" and silu.outputs[0].name == "y"


def test_root_with_other_consumers_is_fused():
    check_fused(PASS, silu_prog(extra="use_root"), ["silu", "add"], prove=True)


@pytest.mark.parametrize(
    "extra",
    ["use_sigmoid", "out_sigmoid", "other"],
    ids=["intermediate_used_elsewhere", "intermediate_is_block_output", "mul_by_another_variable"],
)
def test_not_fused(extra):
    prog = silu_prog(extra=extra)
    check_fused(PASS, prog, op_types(prog), prove=True)


def test_sigmoid_times_itself_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        sig = mb.sigmoid(x=x)
        return mb.mul(x=sig, y=sig)

    check_fused(PASS, prog, ["sigmoid", "mul"], prove=True)


def test_pattern_equals_its_replacement_symbolically():
    fused = run_pass(PASS, silu_pattern)
    assert op_types(fused) == ["silu"]
    assert (proof := prove_equivalent(silu_pattern, fused)).status is ProofStatus.PROVEN, proof
