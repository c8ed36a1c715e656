"""``generic::fold_add_into_epsilon``: ``add(c)`` folded into ``rsqrt``/``inverse``/``log``'s epsilon."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import op_types, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::fold_add_into_epsilon"


QUARTER = np.float32(0.25)


def program(op_type: str = "rsqrt", c=QUARTER, *, swap: bool = False, shape=(3, 4)):
    """``op_type(abs(x) + c, epsilon=1e-3)``, then a ``relu``."""

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        a = mb.abs(x=x)
        v = mb.add(x=c, y=a) if swap else mb.add(x=a, y=c)
        return mb.relu(x=getattr(mb, op_type)(x=v, epsilon=np.float32(1e-3)))

    return prog


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("op_type", ["rsqrt", "inverse", "log"])
def test_folded(op_type, swap):
    prog = program(op_type, np.float32(0.25), swap=swap)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["abs", op_type, "relu"]
    (op,) = ours.functions["main"].find_ops(op_type=op_type)
    assert float(op.epsilon.val) == pytest.approx(0.251, rel=1e-7)
    assert_programs_equivalent(prog, ours, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(
    "c",
    [np.full((4,), 0.25, dtype=np.float32), np.full((2, 3, 4), 0.25, dtype=np.float32)],
    ids=["vector_constant", "broadcasting_constant"],
)
def test_non_scalar_left_alone(c):
    prog = program("rsqrt", c)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)


def test_runtime_addend_left_alone():
    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 4)), mb.TensorSpec(shape=(1,))])
    def prog(x, c):
        return mb.rsqrt(x=mb.add(x=mb.abs(x=x), y=c))

    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)
