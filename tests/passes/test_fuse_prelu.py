"""``common::fuse_prelu``: ``relu(x) + a * relu(-x)`` (BCHW, or after a BHWC transpose) into ``prelu``."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import (
    check_fused,
    check_not_fused,
    op_types,
    prove_by_sign_of_input,
    run_pass,
)

PASS = "common::fuse_prelu"
SHAPE = (2, 3, 4, 5)  # B, C, H, W
A = np.array([0.1, -0.2, 0.3], dtype=np.float32)


def _swap(fn, a: Var, b: Var, swap: bool, **kw) -> Var:
    return fn(x=b, y=a, **kw) if swap else fn(x=a, y=b, **kw)


def prelu_prog(
    alpha: np.ndarray,
    *,
    transpose: list[int] | None = None,
    swap: bool = False,
    neg: float = -1.0,
    shape: tuple[int, ...] = SHAPE,
    extra: str | None = None,
) -> Program:
    """``relu(x) + alpha * relu(-1 * x)``, on ``transpose(x, perm)`` if given.

    ``extra``: ``"use_relu1"`` (``relu(-x)`` used elsewhere), ``"out_relu2"`` (``relu(x)`` is a block
    output), ``"use_root"`` (``x`` used elsewhere: coremltools' matcher refuses, ours fuses).
    """

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        t = mb.transpose(x=x, perm=transpose, name="t") if transpose is not None else x
        relu1 = mb.relu(x=_swap(mb.mul, t, neg, swap, name="neg"), name="relu1")
        scaled = _swap(mb.mul, relu1, alpha, swap, name="scaled")
        relu2 = mb.relu(x=t, name="relu2")
        y = _swap(mb.add, relu2, scaled, swap, name="y")
        if extra == "use_relu1":
            return y, mb.exp(x=relu1)
        if extra == "out_relu2":
            return y, relu2
        if extra == "use_root":
            return y, mb.exp(x=x)
        return y

    return prog


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
@pytest.mark.parametrize("alpha_shape", [(3, 1, 1), (1, 3, 1, 1)])
def test_bchw_is_fused_as_coremltools_does(alpha_shape, swap):
    ours = check_fused(PASS, prelu_prog(A.reshape(alpha_shape), swap=swap), ["prelu"])
    (prelu,) = [op for op in ours.functions["main"].operations if op.op_type == "prelu"]
    np.testing.assert_array_equal(prelu.alpha.val, -A)
    assert prelu.outputs[0].name == "y"


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
@pytest.mark.parametrize("alpha_shape", [(3,), (1, 3), (1, 1, 3), (1, 1, 1, 3)])
def test_bhwc_after_transpose_is_fused_as_coremltools_does(alpha_shape, swap):
    prog = prelu_prog(A.reshape(alpha_shape), transpose=[0, 2, 3, 1], swap=swap)
    ours = check_fused(PASS, prog, ["prelu", "transpose"])
    prelu, transpose = [op for op in ours.functions["main"].operations if op.op_type != "const"]
    assert prelu.x.name == "x" and transpose.outputs[0].name == "y"
    assert list(transpose.perm.val) == [0, 2, 3, 1]


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
def test_uniform_alpha_is_proven_symbolically(swap):
    """With one value on every channel the program is elementwise, so sympy can compare it.

    ``prove_equivalent`` cannot reduce ``Max(0, x) + a * Max(0, -x) - Piecewise((x, x > 0), (-a * x,
    True))`` (it answers ``NOT_PROVEN`` after agreeing samples), so the proof splits on the sign of
    ``x`` itself: on ``x = p``, ``x = -p`` (``p > 0``) and ``x = 0`` every ``Max`` and ``Piecewise``
    resolves and the difference simplifies to 0.
    """
    prog = prelu_prog(np.full((3, 1, 1), 0.3, dtype=np.float32), swap=swap)
    ours = check_fused(PASS, prog, ["prelu"])
    prove_by_sign_of_input(prog, ours)


def test_root_with_other_consumers_is_fused_where_coremltools_refuses():
    """coremltools' generic matcher wants ``x`` to have exactly the pattern's two consumers."""
    prog = prelu_prog(A.reshape((3, 1, 1)), extra="use_root")
    assert op_types(run_pass(PASS, prog, generic=False)) == op_types(prog)
    check_fused(PASS, prog, ["prelu", "exp"], same_as_coremltools=False)


def test_transposed_root_with_other_consumers_is_fused_where_coremltools_raises():
    """With ``x`` used elsewhere, coremltools' generic matcher binds the pattern's root to the
    transpose's other input, the constant ``perm``, and builds ``prelu(x=perm)``, which raises."""
    prog = prelu_prog(A, transpose=[0, 2, 3, 1], extra="use_root")
    with pytest.raises(ValueError, match="prelu"):
        run_pass(PASS, prog, generic=False)
    check_fused(PASS, prog, ["prelu", "transpose", "exp"], same_as_coremltools=False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": A.reshape((3, 1, 1)), "extra": "use_relu1"},
        {"alpha": A.reshape((3, 1, 1)), "extra": "out_relu2"},
        {"alpha": A.reshape((3, 1, 1)), "neg": -2.0},
        {"alpha": np.ones((1, 3, 4, 1), dtype=np.float32)},
        {"alpha": A.reshape((3, 1)), "shape": (2, 3, 4)},
        {"alpha": np.linspace(0.1, 0.5, 5, dtype=np.float32), "transpose": [0, 2, 1, 3]},
    ],
    ids=[
        "intermediate_used_elsewhere",
        "intermediate_is_block_output",
        "neg_is_not_minus_1",
        "alpha_not_per_channel",
        "rank_3",
        "wrong_perm",
    ],
)
def test_not_fused(kwargs):
    check_not_fused(PASS, prelu_prog(**kwargs))


def test_non_constant_alpha_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE), mb.TensorSpec(shape=(3, 1, 1))])
    def prog(x, a):
        return mb.add(x=mb.relu(x=x), y=mb.mul(x=mb.relu(x=mb.mul(x=x, y=-1.0)), y=a))

    check_not_fused(PASS, prog)


def test_one_alpha_for_several_channels_is_declined_where_coremltools_raises():
    """A (1, 1, 1) ``a`` on 3 channels passes coremltools' shape check, but ``prelu`` needs 3 alphas."""
    prog = prelu_prog(np.full((1, 1, 1), 0.25, dtype=np.float32))
    with pytest.raises(ValueError):
        run_pass(PASS, prog, generic=False)
    assert op_types(run_pass(PASS, prog)) == op_types(prog)
