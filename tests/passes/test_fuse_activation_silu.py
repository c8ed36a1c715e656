"""``mil_backend::fuse_activation_silu``: ``x * sigmoid(x)`` into ``silu``."""

from __future__ import annotations

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.fuse_activation_silu import silu_pattern
from pattern_infra.testing.passes import assert_same_program, op_types, run_both, run_pass
from pattern_infra.verify import ProofStatus, assert_programs_equivalent, prove_equivalent

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


def check_same_as_coremltools(prog: Program, expected: list[str]) -> Program:
    """Both passes give the same program, with op types ``expected``, equal to ``prog``."""
    outcome = run_both(PASS, prog)
    assert_same_program(outcome.coremltools, outcome.ours)
    assert op_types(outcome.ours) == expected
    assert_programs_equivalent(prog, outcome.ours, rtol=1e-5)
    assert (proof := prove_equivalent(prog, outcome.ours)).proven, proof
    return outcome.ours


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
def test_fused_as_coremltools_does(swap):
    ours = check_same_as_coremltools(silu_prog(swap), ["silu"])
    (silu,) = [op for op in ours.functions["main"].operations if op.op_type == "silu"]
    assert silu.x.name == "x" and silu.outputs[0].name == "y"


def test_root_with_other_consumers_is_fused():
    check_same_as_coremltools(silu_prog(extra="use_root"), ["silu", "add"])


@pytest.mark.parametrize(
    "extra", ["use_sigmoid", "out_sigmoid", "other"],
    ids=["intermediate_used_elsewhere", "intermediate_is_block_output", "mul_by_another_variable"],
)
def test_not_fused(extra):
    prog = silu_prog(extra=extra)
    check_same_as_coremltools(prog, op_types(prog))


def test_sigmoid_times_itself_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        sig = mb.sigmoid(x=x)
        return mb.mul(x=sig, y=sig)

    check_same_as_coremltools(prog, ["sigmoid", "mul"])


def test_pattern_equals_its_replacement_symbolically():
    fused = run_pass(PASS, silu_pattern)
    assert op_types(fused) == ["silu"]
    assert (proof := prove_equivalent(silu_pattern, fused)).status is ProofStatus.PROVEN, proof
