"""``common::fuse_leaky_relu``: ``maximum(alpha * x, x)`` with ``0 <= alpha <= 1``."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.fuse_leaky_relu import leaky_relu_pattern
from pattern_infra.testing.passes import check_fused, op_types, run_pass
from pattern_infra.verification.symbolic import prove_equivalent

PASS = "common::fuse_leaky_relu"
SHAPE = (2, 3, 4)


def lrelu_prog(
    alpha=0.2, swap_mul: bool = False, swap_max: bool = False, *, extra: str | None = None
) -> Program:
    """``max(x * alpha, x)``; ``swap_*`` flip operands; ``extra`` adds an outside use."""

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        mul = mb.mul(x=alpha, y=x, name="mul") if swap_mul else mb.mul(x=x, y=alpha, name="mul")
        y = mb.maximum(x=x, y=mul, name="y") if swap_max else mb.maximum(x=mul, y=x, name="y")
        if extra == "use_mul":
            return y, mb.exp(x=mul)
        if extra == "out_mul":
            return y, mul
        if extra == "use_root":
            return y, mb.exp(x=x)
        return y

    return prog


def check_same_as_coremltools(prog: Program, expected: list[str]) -> Program:
    """``check_fused``, with a symbolic proof wherever the pass rewrites ``prog``."""
    return check_fused(PASS, prog, expected, prove=expected != op_types(prog))


@pytest.mark.parametrize("swap_max", [False, True], ids=["max_xy", "max_yx"])
@pytest.mark.parametrize("swap_mul", [False, True], ids=["mul_xy", "mul_yx"])
def test_fused_as_coremltools_does(swap_mul, swap_max):
    ours = check_same_as_coremltools(lrelu_prog(0.2, swap_mul, swap_max), ["leaky_relu"])
    (op,) = [op for op in ours.functions["main"].operations if op.op_type == "leaky_relu"]
    assert op.alpha.val == np.float32(0.2) and op.outputs[0].name == "y"


@pytest.mark.parametrize(
    "alpha",
    [0.0, 1.0, np.array([0.3], dtype=np.float32)],
    ids=["alpha_0", "alpha_1", "alpha_shape_1"],
)
def test_alpha_range_ends_and_size_one_tensor(alpha):
    check_same_as_coremltools(lrelu_prog(alpha), ["leaky_relu"])


def test_root_with_other_consumers_is_fused():
    check_same_as_coremltools(lrelu_prog(extra="use_root"), ["leaky_relu", "exp"])


@pytest.mark.parametrize(
    "alpha, extra",
    [
        (0.2, "use_mul"),
        (0.2, "out_mul"),
        (1.5, None),
        (-0.1, None),
        (np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32), None),
    ],
    ids=[
        "intermediate_used_elsewhere",
        "intermediate_is_block_output",
        "alpha_above_1",
        "alpha_below_0",
        "alpha_per_channel",
    ],
)
def test_not_fused(alpha, extra):
    prog = lrelu_prog(alpha, extra=extra)
    check_same_as_coremltools(prog, op_types(prog))


def test_non_constant_alpha_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE), mb.TensorSpec(shape=(1,))])
    def prog(x, alpha):
        return mb.maximum(x=mb.mul(x=x, y=alpha), y=x)

    check_same_as_coremltools(prog, ["mul", "maximum"])


def test_max_with_another_variable_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE), mb.TensorSpec(shape=SHAPE)])
    def prog(x, z):
        return mb.maximum(x=mb.mul(x=x, y=0.2), y=z)

    check_same_as_coremltools(prog, ["mul", "maximum"])


def test_broadcasting_alpha_is_declined():
    """A size-1 alpha of higher rank broadcasts the output to rank 4; ``leaky_relu(x)`` keeps rank 3.

    coremltools fuses anyway and silently changes the program's output shape; we decline.
    """
    prog = lrelu_prog(np.full((1, 1, 1, 1), 0.2, dtype=np.float32))
    theirs = run_pass(PASS, prog, generic=False)
    assert theirs.functions["main"].outputs[0].shape == (2, 3, 4)  # was (1, 2, 3, 4)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["mul", "maximum"]
    assert ours.functions["main"].outputs[0].shape == (1, 2, 3, 4)


def test_integer_input_is_declined_where_coremltools_raises():
    """leaky_relu takes fp16/fp32 only; an int32 ``max(x * 1, x)`` stays."""
    from coremltools.converters.mil.mil import types

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE, dtype=types.int32)])
    def prog(x):
        return mb.maximum(x=mb.mul(x=x, y=np.int32(1)), y=x)

    with pytest.raises(ValueError):
        run_pass(PASS, prog, generic=False)
    assert op_types(run_pass(PASS, prog)) == ["mul", "maximum"]


def test_pattern_equals_its_replacement_symbolically():
    fused = run_pass(PASS, leaky_relu_pattern)
    assert op_types(fused) == ["leaky_relu"]
    assert (proof := prove_equivalent(leaky_relu_pattern, fused)).proven, proof
