"""``common::fuse_onehot_matmul_to_gather``: ``matmul(one_hot(i), W)`` into ``gather(W, i)``.

Random integer inputs are in ``[0, 4)``, inside the one-hot size 4 used here.
"""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import check_fused, check_not_fused, normal_f32, op_types, run_both
from pattern_infra.verification.errors import VerificationError
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_onehot_matmul_to_gather"
f32 = normal_f32(np.random.default_rng(17))
N = 4
IOS17_OPS = ["greater_equal", "shape", "slice_by_index", "add", "select", "gather"]


def onehot_prog(
    indices_shape=(3,), *, opset=None, axis=-1, on=1.0, off=0.0, transpose_y=False, weight=None, extra=None
) -> Program:
    """``matmul(one_hot(i, N, axis, on, off), W)``; ``extra`` adds other users or a dynamic ``W``."""
    w = f32(5, N) if transpose_y else f32(N, 5)
    w = w if weight is None else weight

    @mb.program(
        input_specs=[mb.TensorSpec(shape=indices_shape, dtype=types.int32), mb.TensorSpec(shape=(N, 5))],
        opset_version=opset,
    )
    def prog(i, z):
        oh = mb.one_hot(indices=i, one_hot_vector_size=N, axis=axis, on_value=on, off_value=off, name="oh")
        out = mb.matmul(x=oh, y=z if extra == "dynamic_weight" else w, transpose_y=transpose_y, name="out")
        if extra == "use_onehot":
            return out, mb.relu(x=oh)
        if extra == "out_onehot":
            return out, oh
        if extra == "use_root":
            return out, mb.add(x=i, y=1)
        return out, z

    return prog


@pytest.mark.parametrize("indices_shape", [(3,), (2, 3)], ids=["rank1", "rank2"])
@pytest.mark.parametrize(
    "opset, expected",
    [(None, ["gather"]), (ct.target.iOS16, ["gather"]), (ct.target.iOS17, IOS17_OPS)],
    ids=["default", "iOS16", "iOS17"],
)
def test_fused_as_coremltools_does(opset, expected, indices_shape):
    ours = check_fused(PASS, onehot_prog(indices_shape, opset=opset), expected)
    assert ours.functions["main"].find_ops(op_type="gather")[0].outputs[0].name == "out"


def test_integer_on_off_values_and_root_used_elsewhere():
    check_fused(
        PASS,
        onehot_prog(on=1, off=0, weight=np.arange(20, dtype=np.int32).reshape(N, 5), extra="use_root"),
        ["gather", "add"],
    )


def test_on_value_within_coremltools_tolerance():
    """Fused as coremltools does (``|on - 1| < 1e-3``); the result then differs by that factor."""
    check_fused(PASS, onehot_prog(on=1.0005), ["gather"], rtol=1e-3)


def test_positive_last_axis():
    """``axis = rank(i)`` is the last axis: coremltools normalizes it with the wrong rank and refuses."""
    prog = onehot_prog((2, 3), axis=2)
    outcome = run_both(PASS, prog)
    assert op_types(outcome.coremltools) == ["one_hot", "matmul"]
    assert op_types(outcome.ours) == ["gather"]
    assert_programs_equivalent(prog, outcome.ours)


def test_positive_second_to_last_axis_is_not_fused():
    """``axis = rank(i) - 1`` puts the one-hot axis second to last; coremltools fuses it anyway."""
    prog = onehot_prog((2, N), axis=1)
    outcome = check_not_fused(PASS, prog, same_as_coremltools=False)
    assert op_types(outcome.coremltools) == ["gather"]
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, outcome.coremltools)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "use_onehot"},
        {"extra": "out_onehot"},
        {"extra": "dynamic_weight"},
        {"on": 2.0},
        {"off": 0.5},
        {"transpose_y": True},
        {"weight": f32(2, N, 5)},
    ],
    ids=[
        "intermediate_used_elsewhere",
        "intermediate_is_block_output",
        "non_const_weight",
        "on_value_2",
        "off_value_half",
        "transpose_y",
        "weight_rank_3",
    ],
)
def test_not_fused(kwargs):
    check_not_fused(PASS, onehot_prog(**kwargs))


def test_onehot_on_the_y_side_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(3,), dtype=types.int32)])
    def prog(i):
        one_hot = mb.one_hot(indices=i, one_hot_vector_size=N, on_value=1.0, off_value=0.0)
        return mb.matmul(x=f32(2, 3), y=one_hot)

    check_not_fused(PASS, prog)
