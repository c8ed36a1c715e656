"""``common::fuse_pad_conv``: ``pad`` then ``transpose`` feeding a convolution: the ``pad`` moves after."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import (
    check_fused,
    check_not_fused,
    normal_f32,
    op_types,
    run_both,
    run_pass,
)
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_pad_conv"
f32 = normal_f32(np.random.default_rng(13))
NHWC = (1, 8, 9, 3)


def pad_prog(
    pad=(1, 2, 3, 4, 0, 0), *, mode="constant", perm=(0, 3, 1, 2), conv_type="conv", extra=None
) -> Program:
    """``conv(transpose(pad(x)))`` for an NHWC ``x``; ``extra`` adds other users."""
    pad = np.array(pad, dtype=np.int32)

    @mb.program(input_specs=[mb.TensorSpec(shape=NHWC)])
    def prog(x):
        kwargs = {"constant_val": 0.5} if mode == "constant" else {}
        padded = mb.pad(x=x, pad=pad, mode=mode, name="pad", **kwargs)
        t = mb.transpose(x=padded, perm=list(perm), name="t")
        channels = t.shape[1]
        if conv_type == "conv":
            out = mb.conv(x=t, weight=f32(5, channels, 3, 3), name="conv")
        else:
            out = mb.conv_transpose(x=t, weight=f32(channels, 5, 3, 3), name="conv")
        if extra == "use_transpose":
            return out, mb.relu(x=t)
        if extra == "use_pad":
            return out, mb.relu(x=padded)
        if extra == "out_pad":
            return out, padded
        if extra == "second_transpose":
            t2 = mb.transpose(x=padded, perm=list(perm), name="t2")
            return out, mb.conv(x=t2, weight=f32(2, channels, 1, 1), name="conv2")
        if extra == "transpose_without_conv":
            return out, mb.relu(x=mb.transpose(x=padded, perm=list(perm)))
        return out

    return prog


@pytest.mark.parametrize("conv_type", ["conv", "conv_transpose"])
@pytest.mark.parametrize(
    "pad, mode",
    [
        ((1, 2, 3, 4, 0, 0), "constant"),
        ((0, 0, 1, 2, 3, 4, 0, 0), "constant"),
        ((1, 1, 2, 2, 0, 0), "reflect"),
        ((1, 0, 0, 2, 0, 0), "replicate"),
    ],
    ids=["constant", "full_rank_pad", "reflect", "replicate"],
)
def test_fused_as_coremltools_does(pad, mode, conv_type):
    ours = check_fused(PASS, pad_prog(pad, mode=mode, conv_type=conv_type), ["transpose", "pad", conv_type])
    new_pad = ours.functions["main"].find_ops(op_type="pad")[0]
    assert new_pad.mode.val == mode


@pytest.mark.parametrize("perm", [(0, 3, 2, 1), (0, -1, -3, -2)], ids=["nwhc", "negative_perm"])
def test_other_perms(perm):
    check_fused(PASS, pad_prog(perm=perm), ["transpose", "pad", "conv"])


def test_transpose_with_other_users_moves_too():
    """As in coremltools, every user of the ``transpose`` reads the new ``pad``."""
    check_fused(PASS, pad_prog(extra="use_transpose"), ["transpose", "pad", "conv", "relu"])


def test_pad_feeding_two_transposes():
    """Each ``transpose`` gets its own ``transpose`` + ``pad``; the old ``pad`` goes with the last one.
    (coremltools visits them in set order, so its automatic names may differ: op types and values
    are compared.)"""
    prog = pad_prog(extra="second_transpose")
    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == op_types(outcome.coremltools)
    assert op_types(outcome.ours) == ["transpose", "pad", "conv", "transpose", "pad", "conv"]
    assert_programs_equivalent(prog, outcome.ours)


@pytest.mark.parametrize(
    "extra",
    ["use_pad", "out_pad", "transpose_without_conv"],
    ids=["pad_used_elsewhere", "pad_is_block_output", "sibling_transpose_without_conv"],
)
def test_not_fused(extra):
    check_not_fused(PASS, pad_prog(extra=extra))


def test_transpose_without_conv_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=NHWC)])
    def prog(x):
        return mb.relu(x=mb.transpose(x=mb.pad(x=x, pad=np.array([1, 1, 0, 0], np.int32)), perm=[0, 3, 1, 2]))

    check_not_fused(PASS, prog)


def test_perm_moving_a_padded_axis_out_of_the_padded_ones():
    """The pad covers the last axis, which the ``perm`` moves to axis 1: no pad of the last three
    axes is equivalent. coremltools builds ``pad(pad=False)`` and raises."""
    prog = pad_prog((1, 2), perm=(0, 3, 1, 2))
    with pytest.raises(ValueError, match="got bool"):
        run_pass(PASS, prog, generic=False)
    assert op_types(run_pass(PASS, prog, generic=True)) == op_types(prog)


def test_non_const_pad_is_not_fused():
    """coremltools skips the rewrite but still removes the ops, and raises."""

    @mb.program(input_specs=[mb.TensorSpec(shape=NHWC), mb.TensorSpec(shape=(4,), dtype=types.int32)])
    def prog(x, p):
        amounts = mb.concat(values=[np.zeros(2, np.int32), p, np.zeros(2, np.int32)], axis=0)
        t = mb.transpose(x=mb.pad(x=x, pad=amounts), perm=[0, 3, 1, 2])
        return mb.conv(x=t, weight=f32(5, 3, 3, 3))

    with pytest.raises(ValueError):
        run_pass(PASS, prog, generic=False)
    assert op_types(run_pass(PASS, prog, generic=True)) == op_types(prog)
