"""``generic::remove_unit_tile``: a ``tile`` whose reps are proven all ones is removed."""

from __future__ import annotations

import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.cached_attention import declare_ranges
from pattern_infra.testing.passes import op_types, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::remove_unit_tile"


def broadcast_update(target: str = "own") -> Program:
    """``k`` broadcast, as coremltools' ``copy`` does, to ``target``: ``"own"`` (k's own shape, reps
    ``shape(k) / shape(k)``) or ``"slice"`` (a cache slice ``[S - L, S)``, of length L only if S >= L)."""
    length, cache_len = get_new_symbol(), get_new_symbol()

    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=(1, 2, length, 8)),
            mb.TensorSpec(shape=(1, 2, 16, 8)),
            mb.TensorSpec(shape=(1, 1, length, cache_len)),
        ],
        opset_version=ct.target.iOS18,
    )
    def prog(k, cache, mask):
        k_shape = mb.shape(x=k)
        if target == "own":
            goal = k_shape
        else:
            sizes = mb.shape(x=mask)
            end = mb.gather(x=sizes, indices=3, axis=0)
            begin = mb.sub(x=end, y=mb.gather(x=sizes, indices=2, axis=0))
            view = mb.slice_by_index(
                x=cache,
                begin=mb.concat(values=[0, 0, begin, 0], axis=0),
                end=mb.concat(values=[1, 2, end, 8], axis=0),
                end_mask=[True, True, False, True],
            )
            goal = mb.shape(x=view)
        reps = mb.real_div(x=mb.select(cond=mb.equal(x=goal, y=-1), a=k_shape, b=goal), y=k_shape)
        return mb.relu(x=mb.tile(x=k, reps=reps, name="broadcast"))

    declare_ranges(prog, {str(length): (1, 15), str(cache_len): (1, 15)})
    return prog


def test_tile_by_its_own_shape_removed():
    prog = broadcast_update("own")
    ours = run_pass(PASS, prog)
    assert "tile" not in op_types(ours)
    (relu,) = ours.functions["main"].find_ops(op_type="relu")
    assert relu.x.name == "k"
    rng = np.random.default_rng(0)
    inputs = {
        "k": rng.standard_normal((1, 2, 3, 8)),
        "cache": rng.standard_normal((1, 2, 16, 8)),
        "mask": rng.standard_normal((1, 1, 3, 5)),
    }
    assert_programs_equivalent(prog, ours, inputs=inputs, rtol=0.0, atol=0.0)


def test_tile_to_a_cache_slice_left_alone():
    """``S - L >= 0`` is not proven (L and S are independent inputs); for S < L the slice is empty and the
    tile's reps are 0, not 1."""
    prog = broadcast_update("slice")
    assert op_types(run_pass(PASS, prog)) == op_types(prog)


def test_tile_as_block_output_left_alone():
    n = get_new_symbol()

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, n))])
    def prog(x):
        return mb.tile(x=x, reps=[1, 1])

    assert op_types(run_pass(PASS, prog)) == ["tile"]
