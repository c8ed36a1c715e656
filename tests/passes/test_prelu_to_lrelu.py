"""``common::prelu_to_lrelu``: a ``prelu`` with the same ``alpha`` on every channel becomes ``leaky_relu``."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import check_fused, prove_by_sign_of_input

PASS = "common::prelu_to_lrelu"


def prelu_prog(
    alpha: list[float],
    shape: tuple[int, ...] = (2, 3, 4, 5),
    *,
    extra: str | None = None,
    dtype=types.fp32,
) -> Program:
    """``prelu(x, alpha)``; ``extra="use_root"`` adds another use of ``x``."""
    np_dtype = np.float16 if dtype == types.fp16 else np.float32

    @mb.program(input_specs=[mb.TensorSpec(shape=shape, dtype=dtype)])
    def prog(x):
        y = mb.prelu(x=x, alpha=np.array(alpha, dtype=np_dtype), name="y")
        return (y, mb.exp(x=x)) if extra == "use_root" else y

    return prog


@pytest.mark.parametrize(
    "shape, dtype",
    [((2, 3, 4, 5), types.fp32), ((2, 3, 4), types.fp32), ((2, 3, 4, 5), types.fp16)],
    ids=["rank4", "rank3", "fp16"],
)
def test_common_alpha_becomes_leaky_relu(shape, dtype):
    prog = prelu_prog([0.25] * 3, shape, dtype=dtype)
    ours = check_fused(PASS, prog, ["leaky_relu"])
    (lrelu,) = [op for op in ours.functions["main"].operations if op.op_type == "leaky_relu"]
    assert lrelu.alpha.val == 0.25 and lrelu.alpha.dtype == dtype and lrelu.outputs[0].name == "y"


def test_proven_symbolically():
    """``prelu`` is ``Piecewise((x, x > 0), ...)``, ``leaky_relu`` ``Piecewise((x, x >= 0), ...)``:
    ``prove_equivalent`` leaves that ``NOT_PROVEN`` (with agreeing samples), so the proof splits on the
    sign of ``x``: on ``x = p``, ``x = -p`` (``p > 0``) and ``x = 0`` the difference simplifies to 0."""
    prog = prelu_prog([0.25] * 3)
    ours = check_fused(PASS, prog, ["leaky_relu"])
    prove_by_sign_of_input(prog, ours)


def test_root_with_other_consumers_is_converted():
    check_fused(PASS, prelu_prog([0.1] * 3, extra="use_root"), ["leaky_relu", "exp"])


@pytest.mark.parametrize(
    "alpha", [[0.1, 0.2, 0.3], [0.25, 0.25, 0.25000003]], ids=["distinct", "nearly_equal"]
)
def test_per_channel_alpha_stays_prelu(alpha):
    check_fused(PASS, prelu_prog(alpha), ["prelu"])
