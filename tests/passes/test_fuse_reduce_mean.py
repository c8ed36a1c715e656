"""``common::fuse_reduce_mean``: ``reduce_sum * (1/N)`` and ``reduce_sum / N`` into ``reduce_mean``."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import assert_same_program, op_types, run_both
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_reduce_mean"


def summed(shape=(2, 3, 4, 5), axes=(2, 3), *, op="mul", value=None, keep_dims=None, swap=False, extra=None):
    if value is None:
        n = int(np.prod([shape[a] for a in axes]))
        value = np.float32(1.0 / n if op == "mul" else n)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        kw = {} if keep_dims is None else {"keep_dims": keep_dims}
        s = mb.reduce_sum(x=x, axes=list(axes), name="s", **kw)
        if op == "mul":
            y = mb.mul(x=value, y=s, name="y") if swap else mb.mul(x=s, y=value, name="y")
        else:
            y = mb.real_div(x=value, y=s, name="y") if swap else mb.real_div(x=s, y=value, name="y")
        if extra == "use_sum":
            return y, mb.relu(x=s)
        if extra == "sum_is_output":
            return y, s
        if extra == "use_root":
            return y, mb.relu(x=x)
        return y

    return prog


def assert_as_coremltools(prog: Program) -> Program:
    outcome = run_both(PASS, prog)
    assert op_types(outcome.coremltools)[0] == "reduce_mean"
    assert_same_program(outcome.coremltools, outcome.ours)
    assert_programs_equivalent(prog, outcome.ours, rtol=1e-5)
    return outcome.ours


@pytest.mark.parametrize("swap", [False, True], ids=["s_c", "c_s"])
@pytest.mark.parametrize("keep_dims", [None, True, False], ids=["default", "keep", "drop"])
@pytest.mark.parametrize("axes", [(2, 3), (-1,), (0, 1, 2, 3)], ids=["hw", "last", "all"])
def test_mul_as_coremltools(axes, keep_dims, swap):
    ours = assert_as_coremltools(summed(axes=axes, keep_dims=keep_dims, swap=swap))
    mean = ours.functions["main"].operations[-1]
    assert mean.outputs[0].name == "y" and list(mean.axes.val) == list(axes)


@pytest.mark.parametrize("keep_dims", [None, True], ids=["default", "keep"])
def test_real_div_as_coremltools(keep_dims):
    assert_as_coremltools(summed(op="real_div", keep_dims=keep_dims))


@pytest.mark.parametrize("extra", ["use_root", None])
def test_real_div_within_coremltools_tolerance_and_shared_root(extra):
    assert_as_coremltools(summed(op="real_div", value=np.float32(20.0001), extra=extra))


@pytest.mark.parametrize(
    "prog",
    [
        lambda: summed(value=np.float32(0.3)),  # not 1/N
        lambda: summed(op="real_div", swap=True),  # N / sum
        lambda: summed(extra="use_sum"),
        lambda: summed(extra="sum_is_output"),
        lambda: summed((2, 3, 4, get_new_symbol()), (3,), value=np.float32(0.2)),  # N unknown
    ],
    ids=["wrong_constant", "sum_is_divisor", "sum_used_elsewhere", "sum_is_block_output", "symbolic_axis"],
)
def test_not_fused(prog):
    p = prog()
    outcome = run_both(PASS, p)
    assert_same_program(p, outcome.coremltools)
    assert_same_program(p, outcome.ours)


@pytest.mark.parametrize(
    "prog",
    [
        # N = 10000: 1/N + 9e-7 passes coremltools' absolute 1e-6 but is 0.9% off
        lambda: summed((100, 100), (0, 1), value=np.float32(1e-4 + 9e-7)),
        # N = 3: 3.005 passes coremltools' absolute 1e-2 but is 0.17% off
        lambda: summed((2, 3), (1,), op="real_div", value=np.float32(3.005)),
        # a one-element constant of rank 2 broadcasts the rank-1 sum to rank 2
        lambda: summed((2, 3), (1,), value=np.full((1, 1), 1 / 3, np.float32)),
    ],
    ids=["mul_0.9%_off", "real_div_0.17%_off", "rank_growing_constant"],
)
def test_coremltools_lossy_fusions_are_refused(prog):
    p = prog()
    outcome = run_both(PASS, p)
    assert op_types(outcome.coremltools) == ["reduce_mean"]
    assert_same_program(p, outcome.ours)
